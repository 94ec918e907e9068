"""Each family's verifier on right, wrong, malformed and adversarial answers; alphabet and length rules."""

from __future__ import annotations

import random

import pytest

from learner.models.tokenizer import CharTokenizer
from simulator.families import FAMILIES
from simulator.families.arith import solve
from simulator.families.tools import world_facts
from simulator.text import MARKUP, in_alphabet
from streamer.wire.schema import Task

CONCEPTS = {"arith": ["add10", "sub10", "mul7", "max5", "absdiff9"],
            "string": ["reverse", "sort", "rotl", "rotr", "swap", "double"],
            "format": ["brackets", "parens", "braces", "bars", "quotes", "stars", "colon"],
            "tool": ["look/plain/0", "find/key/1", "get/quoted/2"]}

ADVERSARIAL = [
    "",  # empty
    "   \n ",  # whitespace only
    "7" * 100_000,  # huge
    b"\xff\xfe\x80 7",  # not UTF-8
    "\udcff7",  # surrogate from a surrogateescape decode
    "<call>look(kiv)</call>",  # tool markup injected
    "</obs>42",
    "<obs>42</obs>",
    None,
    12,
]


def _task(family: str, concept: str, seed: int = 0) -> Task:
    prompt, answer, spec = FAMILIES[family].sample(random.Random(seed), concept, {})
    return Task(task_id=f"{family}-{seed}", family=family, concept=concept, prompt=prompt, answer=answer, spec=spec)


def _final_answer(family: str, task: Task) -> str:
    demo = FAMILIES[family].demonstrate(task)
    return demo.rsplit("</obs>", 1)[-1]  # the tool family's answer follows its last observation


def test_the_char_tokenizer_reads_every_family_text_without_an_unknown_token():
    tok = CharTokenizer()
    assert [tok.encode(m) for m in MARKUP] == [[tok.token_to_id[m]] for m in MARKUP]  # one token each
    for family, concepts in CONCEPTS.items():
        for concept in concepts:
            task = _task(family, concept)
            for text in (task.prompt, FAMILIES[family].demonstrate(task)):
                assert tok.unk_id not in tok.encode(text), (family, concept, text)


@pytest.mark.parametrize("family", sorted(CONCEPTS))
def test_right_answer_scores_one_and_texts_are_short(family):
    for concept in CONCEPTS[family]:
        for seed in range(20):
            task = _task(family, concept, seed)
            ans = _final_answer(family, task)
            v = FAMILIES[family].verify(task, ans)
            assert (v.reward, v.success, v.parts["correct"]) == (1.0, True, 1.0), (concept, task.prompt, ans)
            assert FAMILIES[family].verify(task, f"  {ans}\n").reward == 1.0  # surrounding blanks are ignored
            assert len(task.prompt) <= 40 and len(ans) <= 12
            assert in_alphabet(task.prompt) and in_alphabet(FAMILIES[family].demonstrate(task).replace(
                "<call>", "").replace("</call>", "").replace("<obs>", "").replace("</obs>", ""))
            FAMILIES[family].check_spec(task.spec)


@pytest.mark.parametrize("family", sorted(CONCEPTS))
def test_wrong_and_adversarial_answers_score_zero_without_raising(family):
    task = _task(family, CONCEPTS[family][0], 3)
    right = _final_answer(family, task)
    wrong = right + "x" if family != "arith" else str((int(right) + 1) % 10)
    v = FAMILIES[family].verify(task, wrong)
    assert (v.reward, v.success, v.parts["correct"]) == (0.0, False, 0.0)
    for bad in ADVERSARIAL + [right + "<call>", "<obs>" + right]:
        v = FAMILIES[family].verify(task, bad)
        assert v.reward == 0.0 and not v.success and v.parts["correct"] == 0.0, repr(bad)[:40]
        assert len(v.parts) >= 2, "the breakdown says why"


def test_breakdowns_name_the_reason():
    task = _task("string", "reverse")
    f = FAMILIES["string"]
    assert f.verify(task, "").parts["empty"] == 1.0
    assert f.verify(task, "a" * 1000).parts["too_long"] == 1.0
    assert f.verify(task, "<call>x</call>").parts["markup"] == 1.0
    assert f.verify(task, b"\xff\xfe").parts["bad_chars"] == 1.0  # decoded as U+FFFD, outside the alphabet
    assert f.verify(task, 3.5).parts["invalid_type"] == 1.0


def test_arith_semantics_by_hand():
    # 7 - 9 = -2 = 8 (mod 10); 7 * 9 = 63 = 0 (mod 7); max(7, 9) = 9 = 4 (mod 5)
    assert solve("sub", 10, 7, 9) == "8"
    assert solve("mul", 7, 7, 9) == "0"
    assert solve("max", 5, 7, 9) == "4"


def test_format_partial_breakdown():
    task = _task("format", "parens")
    word = task.spec["word"]
    v = FAMILIES["format"].verify(task, f"[{word}]")  # right content, previous wrapper
    assert v.reward == 0.0 and v.parts == {"correct": 0.0, "content": 1.0, "wrapper": 0.0}
    assert FAMILIES["format"].verify(task, f"({word})").reward == 1.0


def test_string_rules_by_hand():
    rules = {"reverse": "dcba", "sort": "abcd", "rotl": "bcda", "rotr": "dabc", "swap": "badc", "double": "aabbccdd"}
    for rule, expected in rules.items():
        t = Task(task_id="x", family="string", concept=rule, prompt="t:abcd=", answer=expected,
                 spec={"rule": rule, "word": "abcd"})
        assert FAMILIES["string"].verify(t, expected).reward == 1.0, rule


def test_world_facts_are_stable_and_drift_between_worlds():
    w0, w1 = world_facts(0), world_facts(1)
    assert w0 == world_facts(0) and set(w0) == set(w1)
    assert sum(w0[k] != w1[k] for k in w0) > len(w0) // 2  # a new world changes most facts


def test_bad_concepts_are_rejected_with_what_is_allowed():
    for family, bad in [("arith", "pow10"), ("arith", "add1"), ("string", "shuffle"), ("format", "angle"),
                        ("tool", "look/json/0"), ("tool", "look")]:
        with pytest.raises(ValueError, match="expected"):
            FAMILIES[family].check_concept(bad)
