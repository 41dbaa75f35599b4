"""The documentation's commands work as written.

Every ``python scripts/X.py ...`` command in a code block of README.md or docs/*.md is
parsed by that script's own argument parser (``build_parser()``), and a run config it
names is loaded with its ``key=value`` overrides; every path under ``configs/``,
``tests/``, ``docs/`` or ``scripts/`` that the pages name exists; a run's published
weights that a command names are ones the shipped config keeps; the programs and extras
the pages tell a user to install exist. Synopsis notation (``[--flag X]``, ``...``) is
dropped before parsing: what is left must parse on its own.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import shlex
import tomllib
from functools import cache
from pathlib import Path

import pytest

from areal_jax.config import load_config

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
SCRIPT = re.compile(r"(?:^|/)scripts/(\w+)\.py$")
# A path the pages name: under one of the repository's own folders.
REPO_PATH = re.compile(r"(?<![\w/.$-])((?:configs|tests|docs|scripts)/[\w.\-/]*\w)")
# Placeholders for the user's own files.
PLACEHOLDER = re.compile(r"(^|/)(my_|your_|[A-Z]\b)|[A-Z]{3,}")  # my_run.yaml, X.py, RUN


def _blocks(page: Path) -> list[str]:
    return FENCE.findall(page.read_text())


def _commands(block: str) -> list[list[str]]:
    """The argument lists after ``python scripts/X.py`` in a code block (continuation lines
    joined; ``&&``, ``;`` and ``|`` split commands; a quoted command, as for ssh, counts;
    a ``<placeholder>`` is one argument)."""
    text = block.replace("\\\n", " ")
    text = re.sub(r"<\S[^<>\n]*>", "PLACEHOLDER", text)  # <checkout of edbeb48>: one argument
    found = []
    for line in text.splitlines():
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            continue
        found += _commands_in(tokens)
    return found


def _commands_in(tokens: list[str]) -> list[list[str]]:
    found, current, redirect = [], [], False
    for tok in [*tokens, "&&"]:
        if redirect:  # the file of "> file"
            redirect = False
            continue
        if re.fullmatch(r"\d?>>?|<", tok):
            redirect = True
            continue
        if re.fullmatch(r"\d?>>?&?\S+|<\S+", tok):  # 2>&1, >file
            continue
        if tok in ("&&", ";", "||", "|", "&"):
            for i, t in enumerate(current):
                if SCRIPT.search(t) and i > 0 and current[i - 1].endswith(("python", "python3")):
                    found.append(current[i:])
                    break
            for t in current:  # a command quoted inside another (ssh --command "...")
                if " " in t and "scripts/" in t:
                    with contextlib.suppress(ValueError):
                        found += _commands_in(shlex.split(t))
            current = []
        else:
            current.append(tok)
    return found


def _drop_synopsis(args: list[str]) -> list[str]:
    """Without ``[optional parts]`` and ``...``: the command as a user would first run it."""
    kept, depth = [], 0
    for a in args:
        if depth == 0 and a.startswith("[") and "=" not in a.split("[")[0]:
            depth += a.count("[") - a.count("]")
            continue
        if depth > 0:
            depth += a.count("[") - a.count("]")
            continue
        if a in ("...", "…"):
            continue
        kept.append(a)
    return kept


def _all_commands() -> list[tuple[str, str, list[str]]]:
    out = []
    for page in PAGES:
        for block in _blocks(page):
            for cmd in _commands(block):
                name = SCRIPT.search(cmd[0]).group(1)
                out.append((page.name, name, _drop_synopsis(cmd[1:])))
    return out


@cache
def _parser(name: str):
    path = REPO / "scripts" / f"{name}.py"
    assert path.exists(), f"scripts/{name}.py does not exist"
    spec = importlib.util.spec_from_file_location(f"_doc_script_{name}", path)
    module = importlib.util.module_from_spec(spec)
    environ = dict(os.environ)
    try:
        spec.loader.exec_module(module)
    finally:  # plan.py sets JAX_PLATFORMS for itself on import: not for the tests after this
        os.environ.clear()
        os.environ.update(environ)
    assert hasattr(module, "build_parser"), f"scripts/{name}.py has no build_parser()"
    parser = module.build_parser()
    return parser[0] if isinstance(parser, tuple) else parser


COMMANDS = _all_commands()


def test_the_pages_hold_commands():
    names = {name for _, name, _ in COMMANDS}
    assert {"train", "eval", "serve", "convert", "plot", "bench", "plan"} <= names, names


@pytest.mark.parametrize("page, name, args", COMMANDS,
                         ids=[f"{p}:{n}:{i}" for i, (p, n, _) in enumerate(COMMANDS)])
def test_command_parses_with_its_scripts_parser(page, name, args):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            parsed = _parser(name).parse_args(args)
        except SystemExit as e:
            pytest.fail(f"{page}: python scripts/{name}.py {shlex.join(args)}\n"
                        f"does not parse (exit {e.code}): {err.getvalue().strip()}")
    config = getattr(parsed, "config", None)
    if config and (REPO / config).is_file():  # the config and its overrides load
        overrides = [o for o in getattr(parsed, "overrides", []) if "=" in o]
        if getattr(parsed, "mesh", None):
            overrides.append(f"mesh={parsed.mesh}")
        load_config(REPO / config, overrides)
    _check_weights_version(page, args)


def _check_weights_version(page: str, args: list[str]) -> None:
    """``runs/NAME/weights/vN`` of a shipped config: N is among the versions the run keeps
    (the last ``checkpoint.keep_weights`` of ``train.total_versions``)."""
    for a in args:
        m = re.fullmatch(r"(runs/[\w.\-]+)/weights/v(\d+)", a)
        if not m:
            continue
        configs = [p for p in (REPO / "configs").glob("*.yaml")
                   if load_config(p).run_dir == m.group(1)]
        for p in configs:
            cfg = load_config(p)
            last, keep = cfg.train.total_versions, cfg.checkpoint.keep_weights
            kept = range(max(last - keep + 1, 0), last + 1)
            assert int(m.group(2)) in kept, (
                f"{page}: {a} is not kept by {p.name} (train.total_versions={last}, "
                f"checkpoint.keep_weights={keep}: v{kept[0]}..v{kept[-1]})")


def _named_paths() -> list[tuple[str, str]]:
    out = []
    for page in PAGES:
        for m in REPO_PATH.finditer(page.read_text()):
            out.append((page.name, m.group(1)))
    return sorted(set(out))


@pytest.mark.parametrize("page, path", _named_paths())
def test_named_path_exists(page, path):
    target = REPO / path
    if target.exists() or PLACEHOLDER.search(path):
        return  # (a placeholder: the user's own file, configs/my_run.yaml, docs/X.md)
    # An output prefix (bench.py --docs docs/longtail writes docs/longtail.md, .png, .json)
    assert list(target.parent.glob(target.name + ".*")), f"{page} names {path}: it does not exist"


def test_programs_and_extras_the_pages_name_exist():
    """``pip install -e '.[X]'`` names an extra of pyproject.toml; TensorBoard, which no
    dependency installs, is always named with the extra that does; no page tells a user to
    run ``huggingface-cli`` (huggingface_hub ships ``hf``)."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for page in PAGES:
        text = page.read_text()
        for m in re.finditer(r"(?:-e\s+'?\.|areal-jax)\[([\w,]+)\]", text):
            for extra in m.group(1).split(","):
                assert extra in extras, f"{page.name} names the extra [{extra}], not in pyproject"
        assert "huggingface-cli" not in text, f"{page.name} names huggingface-cli; use hf"
        for m in re.finditer(r"tensorboard --logdir", text):
            near = text[max(0, m.start() - 300):m.start()]
            assert "[tensorboard]" in near, f"{page.name}: tensorboard without its extra"
    assert any(r.startswith("tensorboard") for r in extras["tensorboard"])


def test_servers_md_generate_sample_is_what_the_shipped_model_answers(tmp_path_factory):
    """docs/servers.md's ``/generate`` example, sent to a server of the model it names
    (greedy, fp32): the reply's text, tokens, finish reason and counts are the page's.
    (The sample once showed a reply the shipped model does not give, issue 39.)"""
    import json

    import httpx
    from server_fixtures import start_server

    text = (REPO / "docs" / "servers.md").read_text()
    block = next(b for b in _blocks(REPO / "docs" / "servers.md") if "/generate" in b
                 and "curl" in b)
    body = json.loads(re.search(r"-d '(\{.*?\})'", block, re.S).group(1))
    model = re.search(r"python scripts/serve.py --model-path (\S+)", text).group(1)
    reply = "\n".join(line.lstrip("# ") for line in block.splitlines() if line.startswith("#"))
    want_text = json.loads(re.search(r'"text": ("[^"]*")', reply).group(1))
    want_ids = json.loads(re.search(r'"output_ids": (\[[^\]]*\])', reply).group(1))
    want_finish = json.loads(re.search(r'"finish_reason": (\{[^}]*\})', reply).group(1))
    with start_server(REPO / model, tmp_path_factory, max_slots=2) as server:
        got = httpx.post(f"{server.url}/generate", json=body, timeout=120).json()
    assert got["text"] == want_text and got["output_ids"] == want_ids, got
    meta = got["meta_info"]
    assert meta["finish_reason"] == want_finish, meta
    for key in ("prompt_tokens", "completion_tokens", "weight_version"):
        assert f'"{key}": {json.dumps(meta[key])}' in reply, (key, meta[key])
