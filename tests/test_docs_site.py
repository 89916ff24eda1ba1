"""The documentation site builds with `mkdocs build --strict` (no broken link or anchor, every page
in the navigation), and its generated pages match what they are generated from: the services'
argument parsers (docs/configuration.md) and OpenAPI documents (docs/reference/*-api.md)."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs"))

import generate_configuration  # noqa: E402  (docs/ is not a package)

from dynamo_lite.web.cli import env_name  # noqa: E402


@pytest.mark.process
def test_mkdocs_builds_the_site_strictly(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install -e '.[docs]')")
    pytest.importorskip("material", reason="the docs extra is not installed (pip install -e '.[docs]')")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, capture_output=True, text=True, timeout=300, env={"NO_MKDOCS_2_WARNING": "1",
                                                                                         "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()


@pytest.mark.process
@pytest.mark.parametrize("generator", ["generate_configuration.py", "generate_routes.py"])
def test_the_generated_pages_are_up_to_date(generator: str) -> None:
    result = subprocess.run([sys.executable, str(ROOT / "docs" / generator), "--check"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (
        f"a generated page is stale: run `python docs/{generator}`:\n{result.stdout}{result.stderr}"
    )


@pytest.mark.process
@pytest.mark.parametrize("program", generate_configuration.PROGRAMS, ids=lambda program: program.script)
def test_every_flag_of_a_service_is_in_the_configuration_page(program: generate_configuration.Program) -> None:
    """Read from the service's --help, independently of the generator: every long option and the
    environment variable the help names for it are in the service's table."""
    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    section = page.split(f"## {program.title}\n", 1)[1].split("\n## ", 1)[0]
    help_text = subprocess.run([sys.executable, "-m", program.module, "--help"], capture_output=True, text=True,
                               timeout=60, check=True).stdout
    parser = generate_configuration.program_parser(program)
    flags = [flag for action in parser._actions for flag in action.option_strings
             if flag.startswith("--") and not isinstance(action, argparse._HelpAction)]
    # The whole parser was caught: the shared service flags (10) and the program's own.
    assert len(flags) >= 12
    for flag in flags:
        assert flag in help_text and f"`{flag}`" in section, flag
    if not program.environment:  # the local stack: flags only
        assert "DYNAMO_LITE_" not in section
        return
    variables = {env_name(action) for action in parser._actions
                 if action.option_strings and not isinstance(action, argparse._HelpAction)}
    assert set(re.findall(r"\[env\s+(DYNAMO_LITE_\w+)\]", help_text)) <= variables
    for variable in variables:  # the help names it, as `[env X]` or in its own words
        assert variable in help_text, variable
        assert f"`{variable}`" in section, variable


@pytest.mark.unit
def test_the_console_scripts_are_named_in_the_docs() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    docs = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    for script in [program.script for program in generate_configuration.PROGRAMS]:
        assert f"{script} = " in pyproject and f"`{script}`" in docs


@pytest.mark.unit
def test_the_readme_is_short_with_two_set_up_commands_and_the_test_command_marker() -> None:
    """One or two screens of prose around the blocks a newcomer runs: the set-up command (both
    services), the test command `.ci/run` reads after its marker, the walkthrough, the Python
    quickstart; the rest lives on the docs site."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 160, "the README grows: move the detail to a docs page"
    shell_blocks = re.findall(r"```sh\n(.*?)```", readme, flags=re.S)
    set_up, test_command, walkthrough = shell_blocks
    assert set_up.count("\n") == 1 and set_up.endswith("-m dynamo_lite.stack --services-only\n"), set_up
    assert readme.count("<!-- test-command -->") == 1
    assert f"<!-- test-command -->\n```sh\n{test_command}```" in readme and test_command.count("\n") == 1
    assert "pip install -e '.[test]'" in test_command and "-m pytest" in test_command
    assert readme.count("<!-- routing-walkthrough -->") == 1 and walkthrough.startswith("B=http://localhost:8091 ")
    assert len(re.findall(r"```python\n", readme)) == 1


@pytest.mark.unit
def test_every_link_of_the_readme_resolves() -> None:
    """The README is not part of the site `mkdocs build --strict` checks: its links are checked here."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert sum(link.startswith("docs/") for link in links) >= 10
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.is_file(), f"README links to {link}: no such file"
        if anchor:
            headings = re.findall(r"^#+ (.*)$", target.read_text(encoding="utf-8"), flags=re.M)
            slugs = {re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", heading).strip().lower()) for heading in headings}
            assert anchor in slugs, f"README links to {link}: no such heading"


@pytest.mark.unit
def test_the_indexers_help_example_keeps_replay_ports_apart_from_publisher_ports() -> None:
    """The --workers example of the indexer's --help shows data-parallel ranks in the layout
    docs/engines.md recommends: rank r publishes on the PUB port + r and replays on the replay
    port + r, so no replay port is another rank's publisher port (5557/5558 would be)."""
    from dynamo_lite.indexer.__main__ import parse_workers

    parser = generate_configuration.service_parser("dynamo_lite.indexer")
    (workers,) = [action for action in parser._actions if "--workers" in action.option_strings]
    example = re.search(r"e\.g\. '([^']+)'", workers.help or "")
    assert example, workers.help
    ranks = parse_workers(example.group(1), model_name="m", tenant_id="default", block_size=16)
    assert {rank.dp_rank for rank in ranks} == {0, 1}, "the example shows two data-parallel ranks"

    def port(endpoint: str | None) -> int:
        assert endpoint is not None and endpoint.startswith("tcp://"), endpoint
        return int(endpoint.rsplit(":", 1)[1])

    publishers = {port(rank.endpoint) - rank.dp_rank for rank in ranks}
    replays = {port(rank.replay_endpoint) - rank.dp_rank for rank in ranks}
    assert len(publishers) == len(replays) == 1, "rank r is on the base port + r"
    ((publisher,), (replay,)) = publishers, replays
    assert abs(replay - publisher) > max(rank.dp_rank for rank in ranks), (publisher, replay)


@pytest.mark.unit
def test_register_peer_says_a_running_indexer_only_lists_the_peer() -> None:
    """Peers are read at start-up (recovery); a peer registered while the indexer runs is listed, not
    used: the route's documentation (the OpenAPI document the service serves, the generated route
    reference) and the indexer page say so."""
    import yaml

    document = yaml.safe_load((ROOT / "openapi" / "indexer.yaml").read_text(encoding="utf-8"))
    description = " ".join(document["paths"]["/register_peer"]["post"]["description"].split())
    for words in ("only at start-up, from `--peers`", "listed, not used", "not kept across a restart"):
        assert words in description, description
        assert words in " ".join((ROOT / "docs" / "reference" / "indexer-api.md").read_text(encoding="utf-8").split())
    assert "listed, not used" in " ".join((ROOT / "docs" / "indexer.md").read_text(encoding="utf-8").split())
