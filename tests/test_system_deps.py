"""scripts/system-deps.sh (run by `make test`) leaves every process it did not start alone, and
`make serve` needs no system package."""
from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "system-deps.sh"
PROGRAMS = ("redis-server", "prometheus")
POLICY_RC_D = Path("/usr/sbin/policy-rc.d")


def path_without(tmp_path: Path, hidden: tuple[str, ...]) -> tuple[Path, Path]:
    """A PATH folder linking every program on PATH but ``hidden``, plus a fake ``apt-get`` that only
    records its arguments (so the script takes its install path without installing anything)."""
    bin_dir, log = tmp_path / "bin", tmp_path / "apt-get.log"
    bin_dir.mkdir()
    for folder in os.environ["PATH"].split(os.pathsep):
        if not os.path.isdir(folder):
            continue
        for name in os.listdir(folder):
            target, link = Path(folder) / name, bin_dir / name
            if name in hidden or name == "apt-get" or link.exists() or not os.access(target, os.X_OK):
                continue
            link.symlink_to(target)
    fake = bin_dir / "apt-get"
    fake.write_text(f'#!/bin/sh\necho "$@" >> "{log}"\nexit 0\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return bin_dir, log


def run_script(path: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PATH": path})


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_a_redis_server_the_user_runs_survives_the_set_up(redis_server, tmp_path):
    """With both programs hidden the script takes its install path (apt-get faked as root; the hint
    otherwise); either way the user's own redis-server, started before it, still answers after it."""
    policy_before = POLICY_RC_D.exists()
    bin_dir, log = path_without(tmp_path, PROGRAMS)
    done = run_script(str(bin_dir))
    assert done.returncode == 0, done.stderr
    with pytest.raises(subprocess.TimeoutExpired):  # a signalled server would exit within this second
        redis_server.proc.wait(timeout=1)
    assert redis_server.client().ping()
    if os.geteuid() == 0:
        assert log.read_text().split("\n")[0].split()[-2:] == list(PROGRAMS), log.read_text()
        assert POLICY_RC_D.exists() == policy_before, "the script left /usr/sbin/policy-rc.d changed"
    else:
        assert not log.exists()
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    if os.geteuid() != 0:
        assert len(lines) == 1 and re.search(r"apt-get install redis-server prometheus", lines[0]), done.stderr


def test_nothing_to_install_is_silent_and_succeeds(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("bash", "id", *PROGRAMS):  # stand-ins: the script only asks whether they are on PATH
        (bin_dir / name).symlink_to(shutil.which(name) or shutil.which("true"))
    done = run_script(str(bin_dir))
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_without_root_it_prints_one_line_and_succeeds(tmp_path):
    """Not root (``id -u`` answers 1000): nothing installed, one line naming what to install, exit 0."""
    bin_dir, log = path_without(tmp_path, (*PROGRAMS, "id"))
    fake_id = bin_dir / "id"
    fake_id.write_text("#!/bin/sh\necho 1000\n")
    fake_id.chmod(0o755)
    done = run_script(str(bin_dir))
    assert done.returncode == 0 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert "redis-server prometheus" in line and "sudo apt-get install" in line
    assert not log.exists()


def test_serving_needs_no_system_package():
    """`make serve` installs the Python environment and serves; the system programs are for the tests."""
    plan = subprocess.run(["make", "-n", "-B", "serve"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert plan.returncode == 0, plan.stderr
    assert "system-deps" not in plan.stdout and "apt-get" not in plan.stdout
    assert "prefixcache serve" in plan.stdout
    test_plan = subprocess.run(["make", "-n", "-B", "test"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "scripts/system-deps.sh" in test_plan.stdout


def test_set_up_with_an_old_python_says_so_before_creating_anything(tmp_path):
    """`make serve` with a Python under 3.10 stops with one line naming the version, not at torch's resolver."""
    old = tmp_path / "python3"
    old.write_text(f"#!{sys.executable}\nimport sys\nsys.version_info = (3, 9, 18, 'final', 0)\n"
                   "if sys.argv[1:2] != ['-c']:\n    sys.exit('called with ' + ' '.join(sys.argv[1:]))\n"
                   "exec(sys.argv[2])\n")
    old.chmod(0o755)
    venv = tmp_path / "venv"
    run = subprocess.run(["make", "install", f"PYTHON={old}", f"VENV={venv}"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode != 0
    assert f"prefixcache needs Python 3.10 or newer and {old} is 3.9" in run.stderr, run.stderr
    assert not venv.exists()
