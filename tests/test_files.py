"""One YAML reader for configurations, specs and protocols: a one-line error naming the file, the
place and the fix."""

import pytest
from typer.testing import CliRunner

from splitleak.cli import app
from splitleak.errors import ConfigError
from splitleak.files import read_yaml

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "text,words",
    [
        (
            "model: tiny-gpt2\n  depth: 2\n",
            r"is not valid YAML at line 2, column 8: mapping values are not allowed here",
        ),
        ("defences: [{name: quant8}\n", r"is not valid YAML at line 2, column 1: .*unclosed bracket"),
        ("- a\n- b\n", r"must hold a mapping \(model: \.\.\.\), not list"),
    ],
)
def test_bad_yaml_gets_one_line_naming_file_place_and_fix(tmp_path, text, words):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=words) as info:
        read_yaml(path, "configuration", "model: ...")
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_missing_file_a_directory_and_non_utf8(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        read_yaml(tmp_path / "none.yaml", "experiment spec")
    with pytest.raises(ConfigError, match="it is a directory"):
        read_yaml(tmp_path, "experiment spec")
    (tmp_path / "latin.yaml").write_bytes(b"name: caf\xe9\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        read_yaml(tmp_path / "latin.yaml", "protocol")


def test_train_config_yaml_error_reaches_the_cli_as_one_line(tmp_path):
    bad = tmp_path / "run.yaml"
    bad.write_text("model: tiny-gpt2\n  depth: 2\n")
    r = CliRunner().invoke(app, ["train", "--config", str(bad), "--out", str(tmp_path / "r")])
    assert r.exit_code == 2 and "line 2, column 8" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "r").exists()
