"""Stand-in roles for the Ray launch tests: a script that records what it saw to `$<out>/<pid>.json`, then idles
until SIGINT (as a role does until the launcher stops it)."""

HEAD = "import json, os, signal, sys, time\n"
TAIL = r"""
path = os.path.join(os.environ[{out!r}], f"{{os.getpid()}}.json")
with open(path + ".tmp", "w") as f:
    json.dump(rec, f)
os.replace(path + ".tmp", path)
signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
while True:
    time.sleep(0.1)
"""


def role_script(body: str, out: str = "OUT") -> str:
    """`body` builds the dict `rec`; the script writes it atomically into the directory `$out` names."""
    return HEAD + body.strip("\n") + "\n" + TAIL.format(out=out)
