"""The operator's admin token: no silent open door at start, rotation without a restart."""

from __future__ import annotations

from pathlib import Path

import pytest
from lora_operator import __main__ as entry
from lora_operator.edges import config
from lora_runtime import tokenfiles

SECRET = "Secret lora/rel-admin-token, key token"


@pytest.mark.parametrize("content", [None, "", "  \n"], ids=["missing", "empty", "blank"])
def test_a_missing_or_empty_token_file_refuses_to_start_naming_the_secret(
    tmp_path: Path,
    content: str | None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv(tokenfiles.secret_env("admin"), SECRET)
    token = tmp_path / "token"
    if content is not None:
        token.write_text(content)
    with pytest.raises(SystemExit) as e:
        config.parse_args(["--admin-token-file", str(token)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert SECRET in err and str(token) in err


def test_no_token_at_all_refuses_to_start_unless_asked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("LORA_ADMIN_TOKEN", raising=False)
    monkeypatch.setenv("LORA_ADMIN_TOKEN", "   ")
    assert entry.main(["--volume-root", "/nonexistent"]) == 2
    assert "--no-admin-token" in capsys.readouterr().err
    c = config.parse_args(["--no-admin-token"])
    assert (c.admin_token, c.no_admin_token) == (None, True)


def test_the_token_file_is_read_again_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("one\n")
    c = config.parse_args(["--admin-token-file", str(path)])
    assert (c.admin_token, c.admin_token_file) == ("one", path)
    f = tokenfiles.TokenFile(path, "admin", c.admin_token)
    assert f.get() == "one"
    # A mounted Secret changes by a symlink swap: a new file under the same name.
    new = tmp_path / "token.new"
    new.write_text("two-longer\n")
    new.replace(path)
    assert f.get() == "two-longer"
    path.unlink()
    assert f.get() == "two-longer"  # gone for a moment: the last good token stays
