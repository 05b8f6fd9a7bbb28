"""bench_demo.py --lockstep pads each demo process's command line and environment to one size, so that
both variants start their stacks alike: checked on real child processes, read back from /proc."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_demo import layout_padding  # noqa: E402

_READ = ("import sys; c = open('/proc/self/cmdline', 'rb').read(); e = open('/proc/self/environ', 'rb').read();"
         " print(len(c) + len(e))")


def _launched_size(cmd: list[str], env: dict[str, str]) -> int:
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return int(out)


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="reads /proc")
def test_two_different_command_lines_and_environments_end_up_the_same_size():
    target = 16384 + 1552
    sizes = set()
    for extra, env_extra in ((["a"], {}), (["b" * 300, "c"], {"SOME_VARIANT_SETTING": "x" * 700})):
        cmd = [sys.executable, "-c", _READ, *extra]
        env = {**os.environ, **env_extra}
        env["LOCKSTEP_LAYOUT"] = layout_padding(cmd, env, target)
        sizes.add(_launched_size(cmd, env))
    assert sizes == {target}


def test_more_than_the_target_is_refused():
    with pytest.raises(ValueError, match="more than"):
        layout_padding(["x" * 100], {"A": "b" * 100}, 150)
