"""Run Horovod's own PyTorch test file against commlayer (scripts/horovod-suite.sh calls this).

``import horovod.torch as hvd`` is pointed at ``commlayer`` by a shim written to a temporary
directory: nothing of Horovod is copied into this repository. The file is the checkout's
test/parallel/test_torch.py, run under ``mpiexec -n NP python -m pytest`` (``--torchrun``:
``torchrun --standalone --nproc_per_node NP -m pytest``, commlayer over torch.distributed's gloo):

- default: every test in its own job with a timeout (a hang or a crash costs one test);
- ``--one-job``: the whole file in one job, as Horovod's CI runs it. After each test the ranks
  meet (horovod_suite_plugin.py); a test that leaves them out of step, or runs past its timeout,
  ends the job, and a fresh job starts at the next test (reported as restarts: 0 when every
  test passes). ``--horovod``: no shim, the installed Horovod (to compare, same harness).

Prints one line a test (passed / failed / skipped / hung, the failing ranks and the first error)
and a summary; exit status 0 when no test failed or hung.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent

_SHIM = {
    "horovod/__init__.py": "import commlayer\n__version__ = commlayer.__version__\n",
    # horovod.torch *is* commlayer: the module object itself, so hvd.X is commlayer.X.
    "horovod/torch/__init__.py": (
        "import sys\nimport commlayer\nsys.modules[__name__] = commlayer\n"
    ),
    "horovod/runner/__init__.py": "",
    "horovod/runner/util/__init__.py": "",
    # What Horovod's test/utils/common.py imports from horovod.runner.
    "horovod/runner/util/threads.py": """import threading


def in_thread(target, args=(), name=None, daemon=True, silent=False):
    def run():
        try:
            target(*args)
        except BaseException:
            if not silent:
                raise
    thread = threading.Thread(target=run, name=name, daemon=daemon)
    thread.start()
    return thread
""",
}


def _write_shim(root: Path, with_horovod_shim: bool) -> None:
    root.mkdir(parents=True, exist_ok=True)
    if with_horovod_shim:
        for rel, text in _SHIM.items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    shutil.copy(HERE / "horovod_suite_plugin.py", root / "hvdsuite_report.py")


def _collect(args: argparse.Namespace, env: dict[str, str], file: Path) -> list[str]:
    select = ["-k", args.k] if args.k else []
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(file),
         "--collect-only", *select],
        cwd=file.parent, env={**env, "HVD_SUITE_REPORTS": tempfile.gettempdir()},
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    tests = [line.rsplit("::", 1)[-1] for line in run.stdout.splitlines() if "::" in line]
    if not tests:
        sys.exit(f"horovod-suite: no tests collected from {file}:\n{run.stdout}{run.stderr}")
    return tests


def _job(args: argparse.Namespace, env: dict[str, str], file: Path, tests: list[str],
         log: Path, timeout_s: float) -> int:  # fmt: skip
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
        if args.torchrun
        else ["mpiexec", "-n"]
    )
    command = [
        *launcher, str(args.np), *([] if args.torchrun else [sys.executable]), "-m", "pytest", "-q",
        "-p", "no:cacheprovider", "-p", "hvdsuite_report", "--rootdir", str(file.parent),
        *(f"{file}::TorchTests::{t}" for t in tests),
    ]  # fmt: skip
    with log.open("ab") as out:
        try:
            proc = subprocess.Popen(command, cwd=file.parent, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            _kill_tree(proc.pid)
            proc.wait()
            return 124


def _kill_tree(pid: int) -> None:
    """Hydra starts the ranks in sessions of their own: kill every descendant of ``pid``."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_bytes()
                children[int(stat.rsplit(b")", 1)[1].split()[1])].append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            todo.append(child)
            try:
                os.kill(child, 9)
            except ProcessLookupError:
                pass


def _records(out: Path) -> Iterator[tuple[int, dict]]:
    """(rank, record) of every line the ranks' plugins wrote, rank by rank in order."""
    for path in sorted(out.glob("rank*.jsonl")):
        rank = int(path.stem[4:])
        for line in path.read_text().splitlines():
            yield rank, json.loads(line)


def _reports(out: Path) -> dict[str, dict[int, dict]]:
    """test -> rank -> its record (a failure kept over a later record of the same test)."""
    per: dict[str, dict[int, dict]] = collections.defaultdict(dict)
    for rank, record in _records(out):
        if per[record["test"]].get(rank, {}).get("outcome") != "failed":
            per[record["test"]][rank] = record
    return per


def _ended_at(out: Path) -> set[str]:
    """The tests at which a rank ended the job (the plugin's "desync" and "hung" records)."""
    return {r["test"] for _, r in _records(out) if r["outcome"] in ("desync", "hung")}


def _finished(records: dict[int, dict], np_: int) -> bool:
    return len(records) == np_ and all(
        r["outcome"] in ("passed", "failed", "skipped") for r in records.values()
    )


def _verdict(records: dict[int, dict], np_: int) -> tuple[str, str]:
    failed = {k: v for k, v in records.items() if v["outcome"] == "failed"}
    if failed:
        first = failed[min(failed)]
        return "failed", f"ranks {sorted(failed)} ({first['when']}): {first['error']}"
    if not _finished(records, np_):
        seen = {k: v["outcome"] for k, v in sorted(records.items())}
        return "hung", f"ranks reporting: {seen}"
    outcomes = {v["outcome"] for v in records.values()}
    if outcomes == {"skipped"}:
        return "skipped", ""
    if outcomes == {"passed"}:
        return "passed", ""
    return "failed", f"ranks disagree: { {k: v['outcome'] for k, v in records.items()} }"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="a horovod/horovod checkout")
    parser.add_argument("np", type=int, nargs="?", default=2, help="ranks (default 2)")
    parser.add_argument("--one-job", action="store_true", help="the whole file in one job")
    parser.add_argument("--horovod", action="store_true", help="the installed Horovod, no shim")
    parser.add_argument(
        "--torchrun", action="store_true", help="torchrun instead of mpiexec (commlayer on gloo)"
    )
    parser.add_argument("-k", help="pytest -k expression selecting tests")
    parser.add_argument("--timeout", type=float, default=180.0,
                        help="seconds a test may take (default 180)")  # fmt: skip
    parser.add_argument(
        "--sync-timeout", type=float,
        help="--one-job: seconds a rank that left a test waits for the others before the test "
        "counts as leaving the ranks out of step (default: --timeout)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, help="keep the per-rank reports and logs here")
    args = parser.parse_args()
    if args.sync_timeout is not None and args.sync_timeout <= 0:
        parser.error("--sync-timeout must be positive")
    if args.torchrun and args.horovod:
        parser.error("--torchrun runs commlayer (Horovod's own needs horovodrun or mpiexec)")
    file = args.checkout.resolve() / "test" / "parallel" / "test_torch.py"
    if not file.is_file():
        parser.error(f"no {file} (is {args.checkout} a horovod/horovod checkout?)")
    work = Path(tempfile.mkdtemp(prefix="horovod-suite."))
    try:
        out = args.out or work / "reports"
        out.mkdir(parents=True, exist_ok=True)
        _write_shim(work / "shim", not args.horovod)
        path = os.environ.get("PYTHONPATH")
        env = {
            **os.environ,
            "PYTHONPATH": str(work / "shim") + (os.pathsep + path if path else ""),
            "HVD_SUITE_REPORTS": str(out),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        }
        tests = _collect(args, env, file)
        start = time.monotonic()
        restarts: list[str] = []
        if args.one_job:
            sync_s = args.timeout if args.sync_timeout is None else args.sync_timeout
            env |= {"HVD_SUITE_SYNC_S": str(sync_s),
                    "HVD_SUITE_TEST_TIMEOUT_S": str(args.timeout)}  # fmt: skip
            remaining = tests
            while remaining:
                _job(args, env, file, remaining, out / "whole.log",
                     args.timeout * (len(remaining) + 1))  # fmt: skip
                per, ended = _reports(out), _ended_at(out)
                # a rank that ended the job at a test (the barrier after it timed out: "desync")
                # ends the tests after it too, though a peer may have reported one of them
                unfinished = [
                    t for t in remaining if t in ended or not _finished(per.get(t, {}), args.np)
                ]
                if not unfinished:
                    break
                culprit = unfinished[0]
                restarts.append(culprit)
                remaining = remaining[remaining.index(culprit) + 1 :]
        else:
            for t in tests:
                _job(args, env, file, [t], out / f"{t}.log", args.timeout)
        per = _reports(out)
        counts: collections.Counter[str] = collections.Counter()
        for t in tests:
            verdict, detail = _verdict(per.get(t, {}), args.np)
            counts[verdict] += 1
            print(f"{verdict:8} {t} {detail}".rstrip())
        target = "Horovod" if args.horovod else "commlayer" + (" under torchrun" * args.torchrun)
        mode = (
            f"one job, restarted after {restarts or 'no test'}" if args.one_job else "a job a test"
        )
        print(
            f"horovod-suite ({target}, {mode}): {args.np} ranks, {len(tests)} tests: "
            f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped, "
            f"{counts['hung']} hung ({time.monotonic() - start:.0f} s)"
        )
        return 1 if counts["failed"] or counts["hung"] else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the shim (and the reports unless --out)


if __name__ == "__main__":
    sys.exit(main())
