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


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def test_readme_config_table_is_the_one_the_dataclasses_make():
    from placement.config import PlacementConfig, _all_keys, keys_table

    block = re.search(r"<!-- keys:[^\n]*-->\n(.*?)\n<!-- /keys -->", _readme(), re.S)
    assert block, "README.md must hold the keys table between its <!-- keys --> markers"
    assert block.group(1) == keys_table(), "regenerate it: python -m placement.config"
    keys = [row.split("`")[1] for row in block.group(1).splitlines()[2:]]
    assert keys == _all_keys(PlacementConfig) and "placement.nccl_topo_file" in keys


def test_readme_is_short_and_every_link_stays_inside_the_repository():
    readme = _readme()
    assert len(readme.splitlines()) <= 200
    assert "../" not in readme
    pages = sorted((ROOT / "docs").glob("*.md"))
    linked = set()
    for doc in [ROOT / "README.md", *pages]:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path = (doc.parent / target.split("#")[0]).resolve()
            assert path.is_file() and ROOT in path.parents, (doc.name, target)
            if doc.name == "README.md":
                linked.add(path)
    assert {p.resolve() for p in pages} <= linked, "every docs/ page is linked from README"


def test_readme_installs_with_the_extras_pyproject_defines():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = set(project["project"]["optional-dependencies"])
    named = set(re.findall(r'pip install "\./placement\[(\w+)\]"', _readme()))
    assert named == extras
    torch_floor = next(d for d in project["project"]["dependencies"] if d.startswith("torch"))
    assert torch_floor in _readme()
    markers = project["tool"]["pytest"]["ini_options"]["markers"]
    assert any(m.startswith("slow:") for m in markers) and '`./dev.sh test -m "not slow"`' in _readme()
