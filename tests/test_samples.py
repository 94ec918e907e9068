"""Answers you can read (issue 47 item 3): the tap's bounded sample of answers as text (`streamer.runs.samples`),
`sao samples`, and the dashboard's latest answers per concept."""

from __future__ import annotations

import json
import sys

import pytest
from kafka_fixtures import scenario_tasks

from learner.models.tokenizer import CharTokenizer
from streamer.runs.artifacts import RunWriter
from streamer.runs.samples import AnswerSampler, SampleSettings, cut, read_samples, samples_path
from streamer.runs.show_samples import main as samples_main
from streamer.runs.tap import Tap, close_tap
from streamer.wire.schema import DriftEvent, LearnerEvent, MetricPoint, Task, Trajectory, decode

TOK = CharTokenizer()


def traj(k: int, concept: str = "add", phase: int = 0, prompt: str = "1+2=", answer: str = "3") -> Trajectory:
    p, a = TOK.encode(prompt, bos=True), TOK.encode(answer)
    return Trajectory(traj_id=f"t{k}", task_id=f"k{k}", family="arith", concept=concept, phase=phase,
                      prompt_len=len(p), tokens=p + a, loss_mask=[0] * len(p) + [1] * len(a),
                      logprobs=[0.0] * len(p) + [-0.5] * len(a), reward=k / 10, policy_version=k // 3,
                      finished_at=100.0 + k)


def sampler(run_dir, keep: int = 2, **kw) -> AnswerSampler:
    return AnswerSampler(run_dir, SampleSettings(keep=keep, **kw), decode=TOK.decode)


def on_file(run_dir) -> dict[str, tuple[bool, bool]]:
    return {s.traj_id: (s.first, s.latest) for s in read_samples(run_dir)}


def test_keeps_the_first_and_latest_k_per_concept_and_phase(tmp_path):
    s = sampler(tmp_path)
    for k in range(1, 6):
        s.add(traj(k, prompt=f"{k}+{k}=", answer=str(2 * k)))
    s.add(traj(6, concept="sub"))
    s.add(traj(7, phase=1))
    s.flush()
    # add/0: t1..t5 -> first t1, t2; latest t4, t5 (t3 neither); sub/0 and add/1: one each, first and latest
    assert on_file(tmp_path) == {"t1": (True, False), "t2": (True, False), "t4": (False, True),
                                 "t5": (False, True), "t6": (True, True), "t7": (True, True)}
    by_id = {x.traj_id: x for x in read_samples(tmp_path)}
    t4 = by_id["t4"]
    assert (t4.prompt, t4.answer, t4.decoded, t4.reward, t4.policy_version, t4.task_id, t4.time) == \
        ("4+4=", "8", True, 0.4, 1, "k4", 104.0)
    assert (by_id["t7"].concept, by_id["t7"].phase) == ("add", 1)


def test_the_file_stays_bounded_whatever_the_run_length(tmp_path):
    s = sampler(tmp_path, keep=3, max_chars=8)
    for k in range(2000):
        s.add(traj(k, concept=f"c{k % 2}", answer="9" * 50))
    s.flush()
    samples = read_samples(tmp_path)
    assert len(samples) == 2 * (3 + 3)  # 2 concepts x (first 3 + latest 3)
    assert {x.traj_id for x in samples if x.latest and x.concept == "c0"} == {"t1994", "t1996", "t1998"}
    assert all(x.answer == "9" * 7 + "…" for x in samples)  # cut to max_chars, the cut marked
    assert len(s.held) == 12  # trajectories pushed out of the latest are forgotten, not held in memory


def test_a_restarted_tap_neither_loses_nor_repeats_an_answer(tmp_path):
    first = sampler(tmp_path)
    for k in range(1, 6):
        first.add(traj(k))
    first.flush()
    again = sampler(tmp_path)  # a restarted tap: loads the file, then reads the topic again from its start
    assert on_file(tmp_path) == {"t1": (True, False), "t2": (True, False), "t4": (False, True), "t5": (False, True)}
    for k in range(1, 6):
        again.add(traj(k))
    again.flush()
    assert on_file(tmp_path) == {"t1": (True, False), "t2": (True, False), "t4": (False, True), "t5": (False, True)}
    for k in (6, 7):  # what arrived after the restart
        again.add(traj(k))
    again.flush()
    ids = [x.traj_id for x in read_samples(tmp_path)]
    assert sorted(ids) == ["t1", "t2", "t6", "t7"] and len(ids) == len(set(ids))
    after = samples_path(tmp_path).read_bytes()
    idle = sampler(tmp_path)
    idle.flush()  # nothing new: the file stays as it was
    assert samples_path(tmp_path).read_bytes() == after and read_samples(tmp_path) == idle.samples()


def test_settings_refuse_an_empty_sample():
    with pytest.raises(ValueError, match="keep"):
        SampleSettings(keep=0)


def test_a_damaged_line_is_named(tmp_path):
    samples_path(tmp_path).write_text('{"traj_id": "t1"}\n')
    with pytest.raises(ValueError, match=r"samples.jsonl:1: not an answer sample"):
        read_samples(tmp_path)


HAND_WRITTEN = [
    {"traj_id": "a", "task_id": "k1", "family": "arith", "concept": "add", "phase": 0, "policy_version": 0,
     "reward": 0.0, "success": False, "time": 1.0, "first": True, "decoded": True, "prompt": "2+2=", "answer": "5",
     "seq": 1},
    {"traj_id": "b", "task_id": "k2", "family": "arith", "concept": "add", "phase": 0, "policy_version": 3,
     "reward": 1.0, "success": True, "time": 2.0, "latest": True, "decoded": True, "prompt": "what is\n3+4?",
     "answer": "7", "seq": 2},
    {"traj_id": "c", "task_id": "k3", "family": "arith", "concept": "sub", "phase": 1, "policy_version": 4,
     "reward": -0.5, "success": False, "time": 3.0, "latest": True, "prompt": "", "answer": "", "seq": 3},
]


def test_sao_samples_prints_the_expected_lines(tmp_path, capsys):
    run = tmp_path / "runs" / "exp1"
    run.mkdir(parents=True)
    samples_path(run).write_text("".join(json.dumps(d) + "\n" for d in HAND_WRITTEN))
    assert samples_main(["exp1", "--runs", str(tmp_path / "runs")]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "arith/add  phase 0  v0  reward +0.00  2+2= -> 5",
        "arith/add  phase 0  v3  reward +1.00  what is\\n3+4? -> 7",
        "arith/sub  phase 1  v4  reward -0.50  task k3: (no text: the tap had no tokenizer)"]
    assert samples_main([str(run), "--concept", "add", "-n", "1"]) == 0
    assert capsys.readouterr().out.splitlines() == ["arith/add  phase 0  v3  reward +1.00  what is\\n3+4? -> 7"]
    assert samples_main([str(run), "--phase", "1"]) == 0
    assert capsys.readouterr().out.startswith("arith/sub  phase 1")
    assert samples_main(["nope", "--runs", str(tmp_path / "runs")]) == 1
    assert "run 'nope': neither a directory nor a run in" in capsys.readouterr().err


def tap_over(bus, run: str, run_dir, tokenizer) -> Tap:
    """The tap of `sao up` (open_tap's types and writer) on an in-memory bus, read to its end and closed."""
    from streamer.wire.topics import Topics

    t = Topics(run)
    consumer = bus.consumer({t.tasks: Task, t.trajectories: Trajectory, t.drift: DriftEvent, t.metrics: MetricPoint,
                             t.learner: LearnerEvent}, group_id=None, dlq=t.dlq)
    tap = Tap(consumer, RunWriter(run_dir, writer_id="tap"),
              sampler=AnswerSampler(run_dir, SampleSettings(keep=2), tokenizer.decode))
    while polled := consumer.poll(max_records=1000, timeout=0.1):
        for p in polled:
            tap.handle(p.msg)
    close_tap(tap, summary=False)
    return tap


def test_a_real_agent_run_gives_answers_whose_text_is_their_tokens(tmp_path, tiny_policy_dir, capsys):
    """The tiny policy answers 16 tasks on the in-memory bus (the real engine and episode loop); the tap's sample
    holds each answer's text as the tokenizer decodes its generated tokens, and the task's prompt."""
    from learner.engines import make_engine
    from streamer.agent.agent import build_agent
    from streamer.transport.memory_bus import MemoryBus
    from streamer.transport.sinks import KafkaTaskSink
    from streamer.wire.settings import AgentSettings
    from streamer.wire.topics import partitions_by_topic

    tasks = scenario_tasks(16)
    bus = MemoryBus()
    bus.create_topics(partitions_by_topic("s"))
    sink = KafkaTaskSink(None, "s", producer=bus.producer())
    for t in tasks:
        sink.write(t)
    engine = make_engine("torch", tiny_policy_dir)
    build_agent(AgentSettings(run="s", max_new_tokens=8, idle_exit_s=0.01), bus, engine, engine.tokenizer).run()
    run_dir = tmp_path / "s"
    tap = tap_over(bus, "s", run_dir, engine.tokenizer)
    assert tap.trajectories == 16
    trajs = {t.traj_id: t for t in (decode(v, Trajectory) for part in bus.logs["s.trajectories"] for _, v in part)}
    prompts = {t.task_id: t.prompt for t in tasks}
    samples = read_samples(run_dir)
    keys = {(t.family, t.concept, t.phase) for t in trajs.values()}
    assert len(keys) >= 4 and {(s.family, s.concept, s.phase) for s in samples} == keys
    for s in samples:
        tr = trajs[s.traj_id]
        assert s.decoded and s.answer == cut(TOK.decode(tr.tokens[tr.prompt_len:]), 1000)
        assert s.prompt == prompts[s.task_id] and (s.reward, s.policy_version) == (tr.reward, tr.policy_version)
    assert sum(len(s.answer) for s in samples) > 0  # the tiny model wrote something
    assert samples_main([str(run_dir), "-n", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == len(keys) and all(" -> " in line for line in out)


def test_dashboard_shows_the_latest_answers_per_concept(tmp_path):
    from dashboard import data

    run = tmp_path / "r1"
    s = sampler(run, keep=4)
    for k in range(1, 9):  # add: t1..t6 (latest 3: t4, t5, t6); sub: t7, t8
        s.add(traj(k, concept="add" if k <= 6 else "sub", prompt=f"{k}+1=", answer=str(k + 1)))
    s.flush()
    df = data.answers_frame(data.load_run(run), n=3)
    assert df[["concept", "prompt", "answer", "version"]].values.tolist() == [
        ["add", "6+1=", "7", 2], ["add", "5+1=", "6", 1], ["add", "4+1=", "5", 1],
        ["sub", "8+1=", "9", 2], ["sub", "7+1=", "8", 2]]
    assert samples_path(run).name in {name for name, *_ in data.run_signature(run)}  # a new sample refreshes the page


def test_dashboard_page_has_the_answers_table_beside_the_reward_chart(tmp_path, monkeypatch):
    from test_dashboard import app, write_run

    monkeypatch.setattr(sys, "argv", list(sys.argv))
    run = write_run(tmp_path)
    s = sampler(run)
    s.add(traj(1, concept="c1", phase=1, prompt="9+9=", answer="18"))
    s.flush()
    at = app(tmp_path)
    assert "Latest answers per concept" in [h.value for h in at.subheader]
    table = next(d.value for d in at.dataframe if "answer" in d.value)
    assert table.to_dict("records") == [{"family": "arith", "concept": "c1", "phase": 1, "version": 0,
                                         "reward": 0.1, "prompt": "9+9=", "answer": "18"}]


def test_an_hf_model_run_gives_the_chat_prompt_and_answer_as_text(tmp_path):
    """A toy Qwen3 with a BPE tokenizer and a chat template (`sao toy-model`'s) answers 3 tasks: the sample holds
    the prompt as the chat template renders it (its special tokens dropped) and the answer as its tokens decode."""
    from learner.engines import make_engine
    from learner.models import load_tokenizer
    from learner.models.toy import build_toy_model
    from simulator.warmstart import scenario_texts
    from streamer.agent.rollouts import run_tasks
    from streamer.wire.settings import AgentSettings

    model_dir = build_toy_model("qwen3", scenario_texts(100) + ["Quelle est la capitale ?"], tmp_path / "m",
                                vocab_size=400)
    tok = load_tokenizer(model_dir)
    tasks = [Task(task_id=f"k{i}", family="ops", concept="exact", prompt=f"Quelle est la capitale {i} ?",
                  answer="oui", spec={"verifier": "exact", "params": {}, "tags": {"source": "ops"}}) for i in range(3)]
    trajs = [t[0] for t in run_tasks(make_engine("torch", model_dir, tok), tok, tasks,
                                     AgentSettings(concurrency=3, max_new_tokens=6, seed=1))]
    s = AnswerSampler(tmp_path / "run", SampleSettings(keep=4), decode=tok.decode)
    for t in trajs:
        s.add(t)
    s.flush()
    samples = {x.task_id: x for x in read_samples(tmp_path / "run")}
    for t, task in zip(trajs, tasks):
        got = samples[task.task_id]
        assert task.prompt in got.prompt and "<|im_start|>" not in got.prompt
        assert got.answer == tok.decode(t.tokens[t.prompt_len:]) and got.decoded


def _wait(cond, timeout_s: float) -> bool:
    import time

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.2)
    return cond()


@pytest.mark.kafka
@pytest.mark.slow
def test_a_tap_killed_and_started_again_keeps_each_answer_once(tmp_path, kafka_bus, bootstrap, kafka_run,
                                                                 tiny_policy_dir):
    """`sao tap --model` on the embedded broker, SIGKILLed after writing its sample, started again after 4 more
    trajectories: it reads the topic again from its start, and the file holds the first 2 and the latest 2 answers,
    each once, as text."""
    import signal
    import subprocess

    from streamer.wire.schema import encode
    from streamer.wire.topics import Topics, partitions_by_topic

    kafka_bus.create_topics(partitions_by_topic(kafka_run))
    producer, topic = kafka_bus.producer(), Topics(kafka_run).trajectories
    run_dir = tmp_path / "run"

    def publish(ks):
        for k in ks:
            producer.send_raw(topic, encode(traj(k, prompt=f"{k}+0=", answer=str(k))), key=b"x")
        producer.flush()

    def start():
        return subprocess.Popen([sys.executable, "-m", "streamer.launch.cli", "tap", "--bootstrap", bootstrap,
                                 "--run", kafka_run, "--run-dir", str(run_dir), "--model", str(tiny_policy_dir),
                                 "--samples-keep", "2", "--no-summary"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    publish(range(1, 6))
    tap = start()
    try:
        assert _wait(lambda: len(on_file(run_dir)) == 4, 90), tap.stderr.read() if tap.poll() is not None else ""
        tap.send_signal(signal.SIGKILL)
        tap.wait(10)
        assert on_file(run_dir) == {"t1": (True, False), "t2": (True, False), "t4": (False, True),
                                    "t5": (False, True)}
        publish(range(6, 10))
        tap = start()
        assert _wait(lambda: set(on_file(run_dir)) == {"t1", "t2", "t8", "t9"}, 90)
        tap.send_signal(signal.SIGTERM)
        assert tap.wait(30) == 0
    finally:
        if tap.poll() is None:
            tap.kill()
    samples = read_samples(run_dir)
    assert [s.traj_id for s in samples if s.first] == ["t1", "t2"] and len(samples) == 4
    assert {s.traj_id: (s.prompt, s.answer) for s in samples if s.latest} == {"t8": ("8+0=", "8"), "t9": ("9+0=", "9")}
