"""The API key can come from a file, so it never has to appear in argv (visible in ps)."""

from __future__ import annotations

import click
from click.testing import CliRunner

from orchard.cli.common import api_key_options


@click.command()
@api_key_options("key")
def show(api_key):
    click.echo(f"key={api_key}")


def test_api_key_from_a_file_or_the_environment(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    runner = CliRunner()
    assert runner.invoke(show, ["--api-key-file", str(key_file)]).output == "key=from-file\n"
    assert runner.invoke(show, [], env={"ORCHARD_API_KEY_FILE": str(key_file)}).output == "key=from-file\n"
    assert runner.invoke(show, [], env={"ORCHARD_API_KEY": "from-env"}).output == "key=from-env\n"
    both = runner.invoke(show, ["--api-key-file", str(key_file)], env={"ORCHARD_API_KEY": "from-env"})
    assert both.exit_code == 2 and "once" in both.output
    key_file.write_text("")
    assert runner.invoke(show, ["--api-key-file", str(key_file)]).exit_code == 2
