"""``serve``'s flags: every default is read from the config dataclasses."""

from __future__ import annotations

import argparse
import dataclasses

from epd_proxy.cli.serve import GROUPS, config_from_args, parse_size, serve_parser, size_text
from epd_proxy.config import SECTIONS, ProxyConfig, ServeOptions


def parse(*argv: str) -> ProxyConfig:
    return config_from_args(serve_parser().parse_args(list(argv)))


_ENV_DEFAULTS = ("ENCODER_MAX_BATCH_SIZE", "VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "EPD_PROXY_UPSTREAM_API_KEY",
                 "ADMIN_API_KEY")


def test_every_serve_default_is_the_config_dataclasses_default(monkeypatch):
    """No flag holds a default of its own: `serve` with no flags is ProxyConfig() (with its
    StageTimeouts) and ServeOptions(), and every flag reaches one of them."""
    for name in _ENV_DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    args = serve_parser().parse_args([])
    read = set()

    class Reading(argparse.Namespace):
        def __getattribute__(self, name):
            read.add(name)
            return super().__getattribute__(name)

    assert config_from_args(Reading(**vars(args))) == ProxyConfig()
    process = dataclasses.asdict(ServeOptions())
    assert {name: getattr(args, name) for name in process} == process
    dests = {action.dest for action in serve_parser()._actions}
    assert dests - read - set(process) == {"help", "config", "simulate"}


def test_environment_variables_set_some_defaults(monkeypatch):
    monkeypatch.setenv("ENCODER_MAX_BATCH_SIZE", "4")
    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "7")
    cfg = parse("--decode", "d:1")
    assert (cfg.encoder_max_batch_size, cfg.upstream_keep_alive) == (4, 7.0)
    assert parse("--decode", "d:1", "--encoder-max-batch-size", "2").encoder_max_batch_size == 2


def test_sizes_read_and_print_alike():
    assert [parse_size(t) for t in ("1048576", "64M", "512k", "1G", "2MiB")] == [1 << 20, 64 << 20, 512 << 10,
                                                                                 1 << 30, 2 << 20]
    assert [size_text(n) for n in (64 << 20, 512 << 20, 1 << 30, 3 << 10, 1000, 0)] == ["64M", "512M", "1G", "3K",
                                                                                      "1000", "0"]


def _other_value(action: argparse.Action) -> list[str]:
    """The flag given once with a value its default is not."""
    flag = action.option_strings[0]
    if action.nargs == 0:
        return [flag]
    if action.choices:
        return [flag, next(c for c in action.choices if c != action.default)]
    if action.type is parse_size:
        return [flag, "1M"]
    if action.type in (int, float):
        return [flag, str((action.default or 0) + (1 if action.type is int else 1.5))]
    return [flag, "x=1"]


def test_every_flag_of_a_group_sets_its_section_and_no_other(monkeypatch):
    """``serve --help`` groups the flags by concern, and each group is one section of the config:
    a flag changes its own group's section and nothing else."""
    for name in _ENV_DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    parser = serve_parser()
    base = config_from_args(parser.parse_args([]))
    section_of_title = {title: key for key, (title, _) in GROUPS.items()}
    seen = set()
    for group in parser._action_groups:
        section = section_of_title.get(group.title or "")
        if section not in SECTIONS:
            continue
        seen.add(section)
        for action in group._group_actions:
            cfg = config_from_args(parser.parse_args(_other_value(action)))
            changed = {name for name in SECTIONS if getattr(cfg, name) != getattr(base, name)}
            assert changed == {section}, (action.option_strings, changed)
            assert (cfg.encode, cfg.prefill, cfg.decode, cfg.discover) == ([], [], [], [])
    assert seen == set(SECTIONS)


def test_every_flag_is_in_one_group_of_the_help():
    parser = serve_parser()
    titles = {title for title, _ in GROUPS.values()}
    grouped = [a.dest for g in parser._action_groups if g.title in titles for a in g._group_actions]
    assert sorted(grouped) == sorted(a.dest for a in parser._actions if a.dest != "help")
    text = parser.format_help()
    assert all(f"\n{title}:\n" in text for title in titles)
