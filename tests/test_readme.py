"""README's two commands are the ones the project runs: CI calls exactly the README test command."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands():
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```(?:bash|sh)\n(.*?)```", text, re.S)
    assert block, "README.md must open with a fenced block holding the two commands"
    # A trailing "# ..." comment explains a command; it is not part of it.
    lines = (line.split(" #", 1)[0].strip() for line in block.group(1).splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def test_readme_opens_with_job_and_test_commands():
    cmds = _readme_commands()
    assert cmds == ["./dev.sh job", "./dev.sh test"]


def test_ci_runs_exactly_the_readme_test_command():
    ci_lines = [l.strip() for l in (ROOT / ".ci" / "run").read_text().splitlines()
                if l.strip() and not l.lstrip().startswith("#")]
    test_cmd = _readme_commands()[1]
    assert ci_lines[-1] == test_cmd
    # No other command in CI but set-up of the shell and the working directory.
    assert all(l == test_cmd or l.startswith(("set ", "cd ")) for l in ci_lines)


def test_dev_sh_treats_no_tests_as_failure():
    dev = (ROOT / "dev.sh").read_text()
    assert '"$rc" -eq 5' in dev and "exit 1" in dev
