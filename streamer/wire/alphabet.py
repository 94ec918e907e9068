"""The embedded character model's text: the characters every simulated prompt, answer and observation is written
in, and the tool-call markup strings.

One definition for the two sides of the contract: the simulator writes and checks its texts in ALPHABET
(`simulator.text`), the character tokenizer has one token per character and per markup string
(`learner.models.tokenizer.CharTokenizer`: its ids follow this order, so a change here changes the tiny model's
vocabulary).
"""

from __future__ import annotations

import string

ALPHABET = string.ascii_lowercase + string.digits + " +-*/%=()[]{}<>:;,.?!_|#@'\"&^~$\n"
MARKUP = ("<call>", "</call>", "<obs>", "</obs>")
