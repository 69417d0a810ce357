"""``kvspec adapter check`` and ``kvspec adapter new`` (docs/targets.md,
"Checking an adapter" and "Starting an adapter")."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import stat
from importlib import resources
from pathlib import Path

from rich.console import Console
from rich.markup import escape

#: what ``adapter new`` writes per language: file in DIR -> skeleton in fuzz/skeletons
SKELETONS: dict[str, dict[str, str]] = {
    "python": {"adapter.py": "adapter.py"},
    "c": {"adapter.c": "adapter.c"},
    "rust": {"Cargo.toml": "Cargo.toml.txt", "src/main.rs": "main.rs", ".gitignore": "gitignore.txt"},
}
#: the program each language's skeleton builds, and how
PROGRAMS = {"python": ("adapter.py", None), "c": ("adapter", "cc -std=c99 -O2 -Wall -o {dir}/adapter {dir}/adapter.c"),
            "rust": ("target/release/kvspec-adapter", "cargo build --release --manifest-path {dir}/Cargo.toml")}


def _console() -> Console:
    return Console(highlight=False, soft_wrap=True, emoji=False)


def _usage(console: Console, message: str, as_json: bool = False) -> int:
    if as_json:
        print(json.dumps({"ok": False, "exit": 2, "error": message}))
    else:
        console.print(f"[bold red]error[/]: {escape(message)}")
    return 2


def command_argv(words: list[str]) -> list[str]:
    """The adapter's command line from ``adapter check``'s words: ``exec:``
    dropped (the target's spelling), one quoted word with spaces split as
    a shell would (unless it is a path that exists)."""
    words = list(words)
    if words and words[0].startswith("exec:"):
        words[0] = words[0].removeprefix("exec:")
        if not words[0]:
            words = words[1:]
    if len(words) == 1 and " " in words[0].strip() and not os.path.exists(words[0]):
        words = shlex.split(words[0])
    return words


def cmd_check(args: argparse.Namespace) -> int:
    """Check an adapter program (``CMD ...``) or a cache class
    (``--target module:Class``); see kvspec.fuzz.adapter_check."""
    from kvspec.fuzz.adapter_check import check_class, check_command
    from kvspec.fuzz.targets import TargetError

    console = _console()
    words = list(args.cmd or [])
    if words[:1] == ["--"]:
        words = words[1:]
    if len(words) > 1 and " " in words[0].strip() and not os.path.exists(words[0].removeprefix("exec:")):
        # one quoted command line: the words after it are this command's own options
        own = argparse.ArgumentParser(prog="kvspec adapter check", add_help=False)
        own.add_argument("--json", action="store_true")
        own.add_argument("--timeout", type=float)
        ns, unknown = own.parse_known_args(words[1:])
        if unknown or (ns.timeout is not None and not 0 < ns.timeout < float("inf")):
            return _usage(console, f"adapter check: after the quoted command line {words[0]!r} only --json and "
                                   f"--timeout S may follow, got {shlex.join(words[1:])!r}", args.json or ns.json)
        args.json = args.json or ns.json
        args.timeout = ns.timeout if ns.timeout is not None else args.timeout
        words = words[:1]
    target = args.target
    if target is not None and target.startswith("exec:"):
        words, target = [target, *words], None
    if target is not None and words:
        return _usage(console, f"adapter check: give either an adapter command or --target, not both "
                               f"(got {shlex.join(words)!r} and --target {target})", args.json)
    if target is None and not words:
        return _usage(console, "adapter check: give the adapter's command line (kvspec adapter check ./adapter "
                               "[ARGS]) or a cache class (--target module:Class)", args.json)
    if target is not None:
        import sys

        saved = list(sys.path)
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())  # a class in the folder the command runs in, as python -m finds it
        try:
            report = check_class(target)
        except TargetError as exc:
            return _usage(console, str(exc), args.json)
        finally:
            sys.path[:] = saved
        what = f"--target {target}"
    else:
        argv = command_argv(words)
        if not argv:
            return _usage(console, "adapter check: the adapter's command line is empty", args.json)
        report = check_command(argv, args.timeout)
        what = shlex.join(argv)
    code = 0 if report.ok else 1
    if args.json:
        print(json.dumps({**report.to_json(), "exit": code}))
        return code
    console.print(f"kvspec adapter check: {escape(what)}"
                  + ("" if target is not None else f" (kvproto; a reply is waited for at most {args.timeout:g} s)"))
    for i, p in enumerate(report.problems, 1):
        console.print(f"[bold red]problem {i}[/] ({escape(p.step)}): {escape(p.sentence)}")
    for note in report.notes:
        console.print(f"note: {escape(note)}")
    console.print(f"passed: {len(report.passed)} step{'' if len(report.passed) == 1 else 's'}" + (f" ({escape(', '.join(report.passed))})"
                                                          if report.passed else ""))
    if report.ok:
        run = f"--target {target}" if target is not None else f"--target {shlex.quote('exec:' + what)}"
        console.print(f"[bold green]clean[/]: no problem found; next: kvspec fuzz {escape(run)}")
    else:
        n = len(report.problems)
        console.print(f"[bold red]{n} problem{'s' if n != 1 else ''}[/]: fix {'them' if n != 1 else 'it'} and run "
                      "kvspec adapter check again")
    return code


#: the C skeleton is the reference adapter (adapters/c/kvspec_dense.c) itself;
#: the copy a user gets names itself as theirs in its hello
RENAMES = {"c": {"kvspec-dense-c": "my-dense-cache-c"}}


def cmd_new(args: argparse.Namespace) -> int:
    """Write a skeleton adapter for ``--lang`` into ``DIR`` (a correct dense
    cache over kvproto/1, with comments where the user's cache goes)."""
    console = _console()
    folder = Path(args.dir)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        return _usage(console, f"adapter new: {args.dir} exists and is not an empty folder; nothing was written "
                               "(give a new folder)")
    files = SKELETONS[args.lang]
    source = resources.files("kvspec.fuzz").joinpath("skeletons")
    try:
        for out, name in files.items():
            path = folder / out
            path.parent.mkdir(parents=True, exist_ok=True)
            text = source.joinpath(name).read_text()
            for ours, theirs in RENAMES.get(args.lang, {}).items():
                text = text.replace(ours, theirs)
            path.write_text(text)
    except OSError as exc:
        return _usage(console, f"adapter new: cannot write into {args.dir}: {exc.strerror or exc}")
    program, build = PROGRAMS[args.lang]
    if args.lang == "python":
        p = folder / program
        p.chmod(p.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    exe = str(folder / program)
    exe = exe if os.path.isabs(exe) or exe.startswith(".") else f"./{exe}"
    console.print(f"wrote {escape(', '.join(str(folder / f) for f in files))} ({args.lang}: a dense cache over "
                  "kvproto/1; the comments marked YOUR CACHE say where your cache goes)")
    if build:
        console.print(f"build:  {escape(build.format(dir=args.dir))}")
    console.print(f"check:  kvspec adapter check {escape(shlex.quote(exe))}")
    console.print(f"fuzz:   kvspec fuzz --target {escape(shlex.quote('exec:' + exe))}")
    return 0


def cmd_adapter(args: argparse.Namespace) -> int:
    return cmd_check(args) if args.adapter_command == "check" else cmd_new(args)
