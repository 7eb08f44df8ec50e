"""tools/set_constants: GRAPHEXEC_SET reaches every process with the folder on PYTHONPATH."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SITE = os.path.join(ROOT, "tools", "set_constants")
READ = "import graphexec.parallel.symmetric as s; print(s.FUSED_NORM, s.ONE_SHOT_BYTES_AT_SIZE_2)"


def _python(code: str, spec: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SITE, ROOT]), GRAPHEXEC_SET=spec)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)


def test_constants_are_set_before_the_program_runs():
    done = _python(READ, "graphexec.parallel.symmetric.FUSED_NORM=False; "
                         "graphexec.parallel.symmetric.ONE_SHOT_BYTES_AT_SIZE_2=1024")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "1024"]
    unset = _python(READ, "")
    assert unset.stdout.split() == ["True", str(4 << 20)], unset.stderr


def test_a_name_that_does_not_exist_or_a_bad_item_stops_the_process():
    missing = _python("print('ran')", "graphexec.parallel.symmetric.NO_SUCH_NAME=1")
    assert missing.returncode != 0 and "has no NO_SUCH_NAME" in missing.stderr
    assert "ran" not in missing.stdout
    bad = _python("print('ran')", "FUSED_NORM")
    assert bad.returncode != 0 and "is not package.module.NAME=value" in bad.stderr
