"""`sao dashboard`: start the Streamlit app (localhost by default).

    sao dashboard [--port 8501] [--address 127.0.0.1] [--runs runs/] [--bootstrap HOST:PORT --run NAME]
                  [--allow-any-broker] [--max-live 4]

Visitors open runs inside --runs only, and the live topics are those of --bootstrap and --run; with
--allow-any-broker a visitor may type a broker and a run, and the server connects there (dashboard.access).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

APP = Path(__file__).with_name("app.py")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sao dashboard", description="SAO Lab dashboard (Streamlit, read-only)")
    p.add_argument("--port", type=int, default=8501)
    p.add_argument("--address", default="127.0.0.1", help="interface to bind (default: localhost only)")
    p.add_argument("--runs", default="runs", help="directory of run directories")
    p.add_argument("--bootstrap", default="", help="Kafka bootstrap servers for live topics")
    p.add_argument("--run", default="", help="run name (topic prefix) to tail live")
    p.add_argument("--refresh", type=float, default=3.0, help="seconds between live refreshes")
    p.add_argument("--allow-any-broker", action="store_true",
                   help="let visitors type a broker and a run to tail (the server connects where they say)")
    p.add_argument("--max-live", type=int, default=4, help="live topic readers held at once (least recently "
                                                            "used stopped first)")
    a = p.parse_args(argv)
    if not 0 < a.port < 65536:
        p.error(f"--port: {a.port} is not a TCP port")
    if a.refresh <= 0:
        p.error("--refresh: must be > 0")
    if a.max_live < 1:
        p.error("--max-live: must be >= 1")
    return a


def streamlit_args(a: argparse.Namespace) -> list[str]:
    """Arguments of `streamlit run` for these options."""
    cmd = ["run", str(APP),
           "--server.address", a.address, "--server.port", str(a.port), "--server.headless", "true",
           "--server.fileWatcherType", "none", "--browser.gatherUsageStats", "false", "--",
           "--runs", a.runs, "--refresh", str(a.refresh), "--max-live", str(a.max_live)]
    if a.bootstrap:
        cmd += ["--bootstrap", a.bootstrap]
    if a.run:
        cmd += ["--run", a.run]
    if a.allow_any_broker:
        cmd += ["--allow-any-broker"]
    return cmd


def command(a: argparse.Namespace) -> list[str]:
    """The dashboard as a separate process (for a launcher that spawns it)."""
    return [sys.executable, "-m", "streamlit", *streamlit_args(a)]


def preload() -> None:
    """Import what the page needs before the server starts: the first visitor would otherwise wait
    for pandas, pyarrow and Altair to import inside the first script run (seconds on a busy CPU)."""
    import pyarrow.parquet  # noqa: F401

    import dashboard.charts  # noqa: F401
    import dashboard.data  # noqa: F401
    import dashboard.live  # noqa: F401


def main(argv: list[str]) -> int:
    a = parse(argv)
    print(f"dashboard: http://{a.address}:{a.port}  (runs: {a.runs})", flush=True)
    if a.allow_any_broker:
        print("dashboard: --allow-any-broker: visitors choose the broker this server connects to", flush=True)
    preload()
    from streamlit.web import cli as stcli

    try:
        stcli.main(args=streamlit_args(a), prog_name="streamlit", standalone_mode=False)
    except KeyboardInterrupt:
        return 130
    return 0
