"""The `headtool` command line: parses, calls the library, renders. No math here."""
from __future__ import annotations

import errno
import inspect
import os
import sys
import traceback
from typing import Annotated, Optional

import typer
from typer.core import TyperGroup

try:  # typer >= 0.26 vendors click (pyproject pins the typer versions this was tested with)
    from typer._click import exceptions as click_exc
except ImportError:  # typer < 0.26 uses click itself
    from click import exceptions as click_exc

from ..console import err_console, print_json
from ..errors import HeadtoolError
from ..measure.speed_spec import SpeedSpec
from ..version import __version__
from ..workflows.requests import EvalRequest, refuse_unused
from .options import MODEL_HELP, JsonOpt, LoadOptions, command_options, data_options, given_options, model_options

_state = {"debug": False}


def _debug() -> bool:
    return _state["debug"] or os.environ.get("HEADTOOL_DEBUG", "") not in ("", "0")


def reflow_help(text: str | None) -> str | None:
    """A command's docstring as help prose: the lines of a paragraph joined, so that the terminal
    wraps them (typer >= 0.2x keeps every source line break, which at 80 columns leaves a ragged
    fragment after each); an `Example...` line and an indented line still start a line of their own."""
    if not text:
        return text
    paragraphs = []
    for para in inspect.cleandoc(text).split("\n\n"):
        lines: list[str] = []
        for line in para.splitlines():
            if lines and not line.startswith(("Example", " ", "\t", "\b")) and not lines[-1].startswith("\b"):
                lines[-1] += " " + line.strip()
            else:
                lines.append(line)
        paragraphs.append("\n".join(lines))
    return "\n\n".join(paragraphs)


def quiet_flags(params) -> None:
    """Show no value type beside on/off flags: typer >= 0.29 prints `<bool>` after every flag
    (--compensate, --json, even --help), which reads as if the flag took a value."""
    for param in params:
        if getattr(param, "is_flag", False) and getattr(param, "metavar", "") is None:
            param.metavar = ""


class HeadtoolGroup(TyperGroup):
    """Maps headtool's errors to one line on stderr and an exit code (2 usage, 1 failure); shows
    each command's help as reflowed prose (reflow_help) with bare flags (quiet_flags)."""

    def get_command(self, ctx, cmd_name):
        cmd = super().get_command(ctx, cmd_name)
        if cmd is not None and not getattr(cmd, "_headtool_reflowed", False):
            cmd.help = reflow_help(cmd.help)
            quiet_flags(cmd.get_params(ctx))  # its options and its help option
            cmd._headtool_reflowed = True
        return cmd

    def get_params(self, ctx):
        params = super().get_params(ctx)
        quiet_flags(params)
        return params

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click_exc.UsageError as e:  # the command line itself: one line too (click draws a box)
            where = e.ctx.command_path if e.ctx is not None else ctx.command_path
            err_console().print(f"error: {e.format_message()} (see {where} --help)", markup=False, style="red",
                                highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
        except (typer.Exit, typer.Abort, click_exc.ClickException):
            raise
        except HeadtoolError as e:
            if _debug():
                traceback.print_exc()
            err_console().print(f"error: {e}", markup=False, style="red", highlight=False, soft_wrap=True)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            err_console().print("interrupted", style="yellow")
            raise typer.Exit(130) from None
        except BrokenPipeError:
            try:
                sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the flush at exit
            except OSError:
                pass
            raise typer.Exit(0) from None
        except OSError as e:  # a failure of the machine (disk full, permissions): one line, exit 1
            if _debug():
                traceback.print_exc()
            where = f" ({e.filename})" if e.filename else ""
            what = (f"no space left on device{where}; free some space or write elsewhere"
                    if e.errno == errno.ENOSPC else f"{e.strerror or str(e).splitlines()[0]}{where}")
            err_console().print(f"error: {what}", markup=False, style="red",
                                highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None
        except MemoryError:
            err_console().print("error: out of memory; try a smaller --batch-size or --seq-len",
                                style="red")
            raise typer.Exit(1) from None
        except Exception as e:  # noqa: BLE001 - the last line of defence against tracebacks
            if _debug():
                traceback.print_exc()
            else:
                err_console().print(
                    f"error: internal error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
                    "(run with --debug for the traceback and please report it)",
                    markup=False, style="red", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None


app = typer.Typer(
    cls=HeadtoolGroup,
    name="headtool",
    help="Score, prune and merge attention heads; write smaller checkpoints that reload anywhere.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"headtool {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="show tracebacks")] = False,
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True,
                                                    help="print the version")] = None,
) -> None:
    _state["debug"] = debug


@app.command()
@model_options
def info(
    model: Annotated[str, typer.Argument(help=MODEL_HELP)],
    json_out: JsonOpt = False,
    load: LoadOptions = LoadOptions(),
) -> None:
    """Architecture, layers, query/KV heads, head_dim, parameters, KV-cache bytes per token.

    KV-cache bytes per token: what one more token adds to the cache, in the layers whose cache grows
    with the context; sliding-window layers (Gemma 2/3 local layers, a config's sliding_window) hold
    at most their window and are stated apart (kv_cache_window_bytes in --json). An encoder keeps no
    KV cache (n/a; null in --json).

    Example: headtool info smollm2-135m --json | jq .num_kv_heads
    """
    from ..workflows.info import InfoRequest, run_info
    from .render import info_table

    figures = run_info(InfoRequest(model, load))
    err_console().print(info_table(model, figures))
    if json_out:
        print_json(figures)


_SPEED = SpeedSpec()  # eval --speed's defaults, for its --help
#: what a speed run reads of the eval options: its tokens come from --data, cut with --seed
_SPEED_READS = ("source", "seed")
#: the speed options that do what a refused loss option may have been meant for
_SPEED_INSTEAD = {"--batch-size": "--batch", "--seq-len": "--context"}


def refuse_loss_options(ctx: typer.Context) -> None:
    """eval --speed times generation on --data's tokens; the loss evaluation's options (block length,
    batch, sample counts, objective...) would be ignored, so giving one is a usage error."""
    from ..data.sources import DataSpec
    from ..optionspec import options_of

    loss = {o.name for o in (*options_of(DataSpec), *options_of(EvalRequest))} - {"models", *_SPEED_READS}
    given = given_options(ctx, loss)
    instead = [f"{speed} instead of {flag}" for flag, speed in _SPEED_INSTEAD.items() if flag in given]
    refuse_unused(given, "without --speed (the loss evaluation)"
                  + (f"; with --speed use {', '.join(instead)}" if instead else ""))


@app.command("eval")
@model_options
@data_options()
@command_options(EvalRequest)
def eval_cmd(
    ctx: typer.Context,
    speed: Annotated[bool, typer.Option("--speed", help="measure inference speed and memory instead of loss, on "
                                        "tokens of --data (with --seed); the other data options and --objective "
                                        "apply without --speed", rich_help_panel="Speed")] = False,
    batch: Annotated[Optional[int], typer.Option("--batch", help=f"sequences per forward (default {_SPEED.batch})",
                                                 rich_help_panel="Speed")] = None,
    context: Annotated[Optional[int], typer.Option("--context", help="prompt tokens per sequence (default "
                                                   f"{_SPEED.context})", rich_help_panel="Speed")] = None,
    new_tokens: Annotated[Optional[int], typer.Option("--new-tokens", help="decode steps with the KV cache "
                                                      f"(default {_SPEED.new_tokens}); an encoder does not "
                                                      "decode (prefill only)",
                                                      rich_help_panel="Speed")] = None,
    repeats: Annotated[Optional[int], typer.Option("--repeats", help="timed runs per model; the median is "
                                                   f"reported (default {_SPEED.repeats})",
                                                   rich_help_panel="Speed")] = None,
    warmup: Annotated[Optional[int], typer.Option("--warmup", help=f"untimed runs first (default {_SPEED.warmup})",
                                                  rich_help_panel="Speed")] = None,
    json_out: JsonOpt = False,
    fields=None,
    load: LoadOptions = LoadOptions(),
    data_spec=None,
) -> None:
    """Loss and perplexity (or accuracy) of models side by side, on exactly the same batches.

    The blocks start after those any of the models was fitted on (headtool outputs record them in
    headtool.json under data_read), unless --skip-samples says where; a model fitted on the text's
    domain is marked: in-domain figures flatter, so evaluate on text of the use as well. Each gap
    from the first model carries one standard error over the blocks (paired: the same blocks for
    both), loss_delta_se in --json: a few blocks give a loose figure.

    With --speed: prefill and decode tokens/s, KV-cache bytes and peak memory growth instead,
    measured interleaved on the same tokens (median, ratio to the first model).

    Example: headtool eval smollm2-135m pruned/ --data builtin:pydoc --max-samples 32
    Example: headtool eval smollm2-135m mqa/ --speed --batch 2 --context 1024 --new-tokens 32
    """
    from ..data.sources import DataSpec

    speed_opts = {"batch": batch, "context": context, "new_tokens": new_tokens, "repeats": repeats,
                  "warmup": warmup}
    if speed:
        from ..workflows.evaluate import SpeedRequest, run_speed
        from .render import speed_table

        refuse_loss_options(ctx)
        spec = SpeedSpec(**{k: v for k, v in speed_opts.items() if v is not None})
        ds = data_spec or DataSpec()
        doc = run_speed(SpeedRequest(fields["models"], spec, source=ds.source, seed=ds.seed, load=load,
                                     new_tokens_given=new_tokens is not None))
        err_console().print(speed_table(doc))
        if json_out:
            print_json(doc)
        return
    refuse_unused([f"--{k.replace('_', '-')}" for k, v in speed_opts.items() if v is not None], "with --speed")

    from ..workflows.evaluate import run_eval
    from .render import eval_table

    result = run_eval(EvalRequest(**fields, data=data_spec or DataSpec(), load=load),
                      skip_given=bool(given_options(ctx, {"skip_samples"})))
    err_console().print(eval_table(result))
    if json_out:
        print_json(result)


def _register_commands() -> None:
    """Commands living in their own modules register themselves here (imports stay light:
    each command imports torch-heavy modules only when it runs)."""
    from .commands import convert, convert_mla, demo, heal, inspect, prune, score
    from .commands import run as recipes

    for mod in (score, prune, convert, convert_mla, inspect, heal, recipes, demo):
        mod.register(app)


_register_commands()


def debug_first(argv: list[str]) -> list[str]:
    """argv with --debug moved before the command, the only place the parser takes it, so that it
    works anywhere (`headtool info x --debug`) as the README says; after `--` it is an argument."""
    end = argv.index("--") if "--" in argv else len(argv)
    if "--debug" not in argv[1:end]:
        return argv
    rest = [a for a in argv[1:end] if a != "--debug"]
    return [argv[0], "--debug", *rest, *argv[end:]]


def main() -> None:
    """Console-script entry point."""
    sys.argv = debug_first(sys.argv)
    if "--debug" in sys.argv[1:2]:
        _state["debug"] = True
    try:
        app()
    except SystemExit as e:
        # rich exits 1 when a reader closes the pipe under the help it prints (`headtool prune --help |
        # head`); the commands end 0 there (HeadtoolGroup.invoke): the reader took what it wanted
        if e.code == 1 and isinstance(e.__context__, BrokenPipeError):
            raise SystemExit(0) from None
        raise


if __name__ == "__main__":  # pragma: no cover
    main()
