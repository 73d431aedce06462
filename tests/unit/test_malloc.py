"""Allocator tuning (commlayer/core/malloc.py): that it removes the page faults of a step that frees
and allocates again the same blocks, that it leaves malloc alone when told to or when the user
chose glibc settings, and how config finds those settings. Each tuning runs in a fresh
interpreter: mallopt is process-wide and cannot be undone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from commlayer.common import config

# 22 training steps of an MLP like benchmarks/train.py's (10 x Linear(768, 768), 24 MB of
from commlayer.core import malloc

# gradients freed by zero_grad and allocated again by backward every step); prints the minor
# page faults of steps 3-22 after the tuning named on the command line.
_STEPS = """
import json, resource, sys
import torch
from commlayer.core import malloc
status = malloc.tune(sys.argv[1] == "on", json.loads(sys.argv[2]))
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(768, 768) for _ in range(10)])
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
inputs = torch.randn(32, 768)
faults = []
for step in range(22):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    optimizer.zero_grad()
    model(inputs).square().mean().backward()
    optimizer.step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"status": status, "faults": sum(faults[2:])}))
"""

glibc_only = pytest.mark.skipif(malloc._glibc() is None, reason="needs glibc's mallopt")


def _steps(setting: str, user_variables: list[str] | None = None) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", _STEPS, setting, json.dumps(user_variables or [])],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@glibc_only
def test_tuning_removes_the_page_faults_of_repeated_steps() -> None:
    untuned = _steps("off")
    tuned = _steps("on")
    assert untuned["status"] == "off (COMMLAYER_MALLOC_TUNING=off)"
    assert str(tuned["status"]).startswith("tuned: glibc mmap threshold 32 MiB")
    # Untuned glibc hands the gradients back to the OS and faults them in again: ~13,000 faults
    # in most steps, but now and then a run of steps takes only 600-2,800 (its dynamic
    # threshold briefly covers them), so 8 counted steps summed anywhere from 18,000 to 104,000;
    # 20 counted steps measured 214,000-260,000. Tuned, the steps reuse the heap: 578-1,153.
    assert int(untuned["faults"]) > 20_000  # type: ignore[call-overload]
    assert int(tuned["faults"]) < 5_000  # type: ignore[call-overload]


@glibc_only
def test_user_glibc_settings_are_left_alone() -> None:
    result = _steps("on", ["MALLOC_TRIM_THRESHOLD_"])
    assert result["status"] == "left to the user's MALLOC_TRIM_THRESHOLD_"
    assert int(result["faults"]) > 20_000  # type: ignore[call-overload]


def test_bad_setting_is_refused() -> None:
    with pytest.raises(config.ConfigError, match="COMMLAYER_MALLOC_TUNING='sometimes'.*boolean"):
        config.load(environ={"COMMLAYER_MALLOC_TUNING": "sometimes"})


def test_glibc_malloc_variables_found_in_the_environment() -> None:
    assert config.glibc_malloc_variables({}) == []
    assert config.glibc_malloc_variables({"MALLOC_ARENA_MAX": "2", "PATH": "/bin"}) == []
    env = {"MALLOC_MMAP_THRESHOLD_": "1", "MALLOC_TOP_PAD_": "0"}
    assert config.glibc_malloc_variables(env) == ["MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_"]
    tunables = {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1:glibc.pthread.rseq=0"}
    assert config.glibc_malloc_variables(tunables) == ["GLIBC_TUNABLES"]
    assert config.glibc_malloc_variables({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"}) == []
