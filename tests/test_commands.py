"""Application subcommands reach ``gradest`` through the ``gradest.commands`` entry points."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import types

import pytest

from gradest import cli, commands, entry_points


def _fake_group(monkeypatch, group, entries):
    """Make ``importlib.metadata.entry_points(group=group)`` return ``entries``."""
    real = entry_points.entry_points

    def fake(**kwargs):
        if kwargs.get("group") == group:
            return entries
        return real(**kwargs)

    monkeypatch.setattr(entry_points, "entry_points", fake)
    commands.registered_commands.cache_clear()
    monkeypatch.setattr(commands, "registered_commands", commands.registered_commands)


@pytest.fixture
def plugin_module(monkeypatch):
    """A module ``fake_app`` holding a working command, a broken one and a non-command."""
    module = types.ModuleType("fake_app")
    calls = []

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--times", type=int, default=1)

    def run(args: argparse.Namespace) -> int:
        calls.append(args.times)
        return 0

    module.hello = commands.Command(help="say hello", add_arguments=add_arguments, run=run)
    module.not_a_command = object()
    module.calls = calls
    monkeypatch.setitem(sys.modules, "fake_app", module)
    yield module
    commands.registered_commands.cache_clear()


def _entry(name, value):
    return importlib.metadata.EntryPoint(name=name, value=value, group=commands.GROUP)


def test_a_registered_command_is_a_subcommand(monkeypatch, plugin_module, capsys):
    _fake_group(monkeypatch, commands.GROUP, [_entry("hello", "fake_app:hello")])
    assert "hello" in cli.build_parser().format_help()
    assert cli.main(["hello", "--times", "3"]) == 0
    assert plugin_module.calls == [3]


def test_broken_command_plugins_warn_and_are_skipped(monkeypatch, plugin_module):
    entries = [
        _entry("hello", "fake_app:hello"),
        _entry("broken", "fake_app_missing_module:command"),
        _entry("wrong", "fake_app:not_a_command"),
    ]
    _fake_group(monkeypatch, commands.GROUP, entries)
    with pytest.warns(RuntimeWarning) as caught:
        found = commands.registered_commands()
    assert set(found) == {"hello"}
    text = " ".join(str(w.message) for w in caught)
    assert "'broken'" in text and "'wrong'" in text and "not a gradest.plugin.Command" in text
    # gradest's own commands keep working next to broken plugins
    help_text = cli.build_parser().format_help()
    assert all(name in help_text for name in ("list", "check"))


def test_a_command_cannot_replace_a_library_command(monkeypatch, plugin_module, capsys):
    _fake_group(monkeypatch, commands.GROUP, [_entry("list", "fake_app:hello")])
    assert cli.main(["list"]) == 0
    assert plugin_module.calls == []  # gradest's own `list` ran
    assert "exact" in capsys.readouterr().out


def test_an_application_command_without_its_application_names_the_install(monkeypatch, capsys):
    _fake_group(monkeypatch, commands.GROUP, [])
    for command in ("finetune", "pretrain"):
        assert cli.main([command, "--steps", "2"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1
        assert "gradest-digits" in err and "pip install ./lab ./apps/digits" in err
    for command in ("compare", "race", "cost"):  # the lab's, beside the library
        assert cli.main([command, "--steps", "2"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1
        assert "gradest-lab" in err and "pip install ./lab`" in err
    commands.registered_commands.cache_clear()


def test_the_installed_digits_application_registers_its_commands():
    pytest.importorskip("gradest_digits")
    commands.registered_commands.cache_clear()
    assert {"finetune", "pretrain"} <= set(commands.registered_commands())


def test_a_closed_pipe_ends_the_command_quietly():
    """``gradest list --verbose | head -1``: no BrokenPipeError traceback."""
    import subprocess

    reader = subprocess.Popen(["head", "-c", "1"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    writer = subprocess.run(
        [sys.executable, "-m", "gradest.cli", "list", "--verbose"],
        stdout=reader.stdin,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
    )
    reader.stdin.close()
    reader.wait(timeout=60)
    assert "Traceback" not in writer.stderr
    assert writer.returncode in (0, 141)
