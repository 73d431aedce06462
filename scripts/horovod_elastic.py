"""Run Horovod's own elastic integration tests against commlayerrun (scripts/horovod-elastic.sh
calls this).

The tests are the checkout's test/integration/elastic_common.py (class BaseElasticTests: its
schedules and assertions, unchanged), run by a unittest class of our own instead of Horovod's
test_elastic_torch.py, which skips four of them for its own bugs (issues 2030 and 2908): here
all eleven cases run. The training script is the checkout's
test/integration/data/elastic_torch_main.py with its import line changed to
``import commlayer as hvd``, nothing else.

What the tests import of ``horovod.runner`` is a shim written to a temporary directory (nothing
of Horovod is copied into this repository): ``parse_args`` keeps the command line the test
built for horovodrun, and ``_run_elastic`` runs it through ``commlayerrun`` (which takes
horovodrun's elastic flags), with ``--elastic-timeout`` from the test's patched
ELASTIC_TIMEOUT_SECS. A job that fails raises RuntimeError with Horovod's words ("Horovod
detected that one or more processes exited with non-zero status") and commlayerrun's reason;
RESET_LIMIT_EXCEEDED_MESSAGE is commlayerrun's own message for that case. Horovod's
test_min_hosts_timeout calls its helper with ``np=4``, a keyword the helper does not take: it
fails so under Horovod too, and is left out unless ``--all``; test_min_hosts_timeout_as_meant
runs it with ``num_proc=4``.

Prints pytest's report; exit status 0 when every test passed. ``--runs N`` repeats the file.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from horovod_suite import _SHIM as _SUITE_SHIM  # horovod.torch, horovod.runner.util.threads

_IMPORT = "import horovod.torch as hvd"

_LAUNCH = """import shutil
import subprocess
import sys
import types

from horovod.runner.elastic import driver


def parse_args():
    return types.SimpleNamespace(argv=list(sys.argv[1:]))


def _run_elastic(args):
    command = [shutil.which("commlayerrun") or "commlayerrun", *args.argv]
    if driver.ELASTIC_TIMEOUT_SECS != driver.DEFAULT_ELASTIC_TIMEOUT_SECS:
        command[1:1] = ["--elastic-timeout", str(driver.ELASTIC_TIMEOUT_SECS)]
    print("commlayerrun:", " ".join(command[1:]), flush=True)
    proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(proc.stdout, flush=True)
    if proc.returncode != 0:
        why = [line for line in proc.stdout.splitlines() if "elastic job failed" in line]
        raise RuntimeError(
            "Horovod detected that one or more processes exited with non-zero status "
            f"(commlayerrun exited with {proc.returncode}: {' '.join(why) or 'no reason given'})"
        )
"""

_SHIM = {
    **_SUITE_SHIM,
    "horovod/runner/launch.py": _LAUNCH,
    "horovod/runner/gloo_run.py": "def _get_min_start_hosts(settings):\n    return 1\n",
    "horovod/runner/common/__init__.py": "",
    "horovod/runner/common/util/__init__.py": "",
    "horovod/runner/common/util/config_parser.py": "def set_env_from_args(env, args):\n    pass\n",
    "horovod/runner/elastic/__init__.py": "",
    "horovod/runner/elastic/driver.py": (
        "DISCOVER_HOSTS_FREQUENCY_SECS = 1.0\n"
        "DEFAULT_ELASTIC_TIMEOUT_SECS = ELASTIC_TIMEOUT_SECS = 600\n"
    ),
    "horovod/runner/elastic/constants.py": (
        "RESET_LIMIT_EXCEEDED_MESSAGE = 'the world re-formed --reset-limit {} times'\n"
    ),
}

_TESTS = '''import unittest

import mock
import pytest
from elastic_common import BaseElasticTests


class CommlayerElasticTests(BaseElasticTests, unittest.TestCase):
    def __init__(self, *args, **kwargs):
        super().__init__({script!r}, *args, **kwargs)

    @mock.patch("horovod.runner.elastic.driver.ELASTIC_TIMEOUT_SECS", 1)
    def test_min_hosts_timeout_as_meant(self):
        """Horovod's test_min_hosts_timeout, with num_proc=4 where it passes np=4."""
        with pytest.raises(RuntimeError, match="one or more processes exited with non-zero"):
            self._run([(None, ["localhost:2", "127.0.0.1:2"])], exit_schedule={{"(1, 0)": [0]}},
                      num_proc=4, min_num_proc=4)
'''
# Horovod's own test_min_hosts_timeout fails in its helper's call (TypeError: np=) under
# Horovod too: left out unless --all, and run as meant (test_min_hosts_timeout_as_meant).
_BROKEN_IN_HOROVOD = "test_min_hosts_timeout"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="a horovod/horovod checkout")
    parser.add_argument("--runs", type=int, default=1, help="run the file N times (default 1)")
    parser.add_argument("-k", help="pytest -k expression selecting tests")
    parser.add_argument(
        "--all", action="store_true", help=f"also Horovod's {_BROKEN_IN_HOROVOD} as written"
    )
    args = parser.parse_args()
    integration = args.checkout.resolve() / "test" / "integration"
    common, main_py = integration / "elastic_common.py", integration / "data/elastic_torch_main.py"
    for path in (common, main_py):
        if not path.is_file():
            parser.error(f"no {path} (is {args.checkout} a horovod/horovod checkout?)")
    if shutil.which("commlayerrun") is None:
        parser.error("commlayerrun is not on PATH (pip install -e . in this environment)")
    work = Path(tempfile.mkdtemp(prefix="horovod-elastic."))
    try:
        for rel, text in _SHIM.items():
            path = work / "shim" / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        source = main_py.read_text()
        if source.count(_IMPORT) != 1:
            sys.exit(f"horovod-elastic: {main_py} does not import horovod.torch as expected")
        script = work / "elastic_torch_main.py"
        script.write_text(source.replace(_IMPORT, "import commlayer as hvd"))
        (work / "test_commlayer_elastic.py").write_text(_TESTS.format(script=str(script)))
        path = os.pathsep.join(
            [str(work / "shim"), str(integration), str(integration.parent / "utils")]
            + [p for p in [os.environ.get("PYTHONPATH")] if p]
        )
        env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
        failed = 0
        for run in range(1, args.runs + 1):
            print(f"==== run {run} of {args.runs}", flush=True)
            command = [sys.executable, "-m", "pytest", "-v", "-rA", "-p", "no:cacheprovider"]
            command += [str(work / "test_commlayer_elastic.py")]
            select = [args.k] if args.k else []
            select += [] if args.all else [f"not ({_BROKEN_IN_HOROVOD} and not as_meant)"]
            command += ["-k", " and ".join(f"({k})" for k in select)] if select else []
            failed += subprocess.call(command, cwd=work, env=env) != 0
        print(f"==== {args.runs - failed} of {args.runs} run(s) passed every test", flush=True)
        return 1 if failed else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
