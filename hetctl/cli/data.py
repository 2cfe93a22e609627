"""``hetctl data prepare``: tokenize text into the Megatron indexed dataset the trainer reads."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Callable, Iterator

import typer

from hetctl.cli.root import app
from hetctl.cli.base import err, handle_errors, may_be_terminal, out, print_json, text

data_app = typer.Typer(name="data", help="Prepare training data.", no_args_is_help=True)
app.add_typer(data_app)


@data_app.command("prepare")
@handle_errors
def prepare_cmd(
    inputs: list[str] = typer.Argument(..., metavar="INPUT", help=".txt, .jsonl or .parquet files, in order."),
    output: str = typer.Option(..., "-o", "--output", metavar="PREFIX",
                               help="Writes PREFIX.bin and PREFIX.idx (Megatron's indexed format)."),
    tokenizer: str = typer.Option(..., "--tokenizer", metavar="PATH|bytes",
                                  help="A Hugging Face tokenizer folder (its tokenizer.json), or `bytes` "
                                  "(UTF-8 bytes: vocabulary 257, end of document 256)."),
    txt_split: str = typer.Option("paragraph", "--txt-split", metavar="paragraph|line|file",
                                  help="What a document is in a .txt file: lines up to a blank line (default), "
                                  "each line, or the whole file."),
    text_key: str = typer.Option("text", "--text-key", help="The text field of .jsonl records and .parquet rows."),
    max_doc_bytes: int = typer.Option(1 << 20, "--max-doc-bytes",
                                      help="Skip (and count) documents longer than this many bytes (default 1 MiB)."),
    json_out: bool = typer.Option(False, "--json", help="Print the report as JSON on stdout, no progress bar."),
) -> None:
    """Tokenize documents, append the end-of-document id to each, and write them as one dataset.

    Output is written to temporary files and renamed at the end: an interrupted
    run leaves no PREFIX.idx behind. Empty and over-long documents are skipped and
    counted; bytes that are not UTF-8 are replaced by U+FFFD and counted.
    """
    try:
        import numpy  # noqa: F401
    except ImportError:
        from hetctl.errors import HetctlError

        raise HetctlError("`hetctl data prepare` needs numpy", "pip install 'hetctl[train]' (numpy, tokenizers)") from None
    from hetctl.corpus.prepare import Options, check_inputs, prepare
    from hetctl.corpus.tokenize import load_tokenizer

    opts = Options(tuple(Path(p) for p in inputs), Path(output), txt_split, text_key, max_doc_bytes)
    total = check_inputs(opts)
    tok = load_tokenizer(tokenizer)
    with _progress(total, enabled=not json_out and may_be_terminal(sys.stderr)) as advance:
        report = prepare(opts, tok, advance)
    if json_out:
        print_json(json.dumps(report.to_dict(), indent=2))
        return
    _render(report)


@contextlib.contextmanager
def _progress(total: int, enabled: bool) -> Iterator[Callable[[int], None]]:
    """A bytes-read progress bar on stderr; a no-op callback when disabled."""
    if not enabled:
        yield lambda n: None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                  console=err.rich, transient=True) as bar:
        task = bar.add_task("tokenizing", total=total)
        yield lambda n: bar.advance(task, n)


def _render(report) -> None:
    from hetctl.corpus.sources import REASONS

    out.print(text(("wrote ", "green"), f"{report.prefix}.bin/.idx: {report.documents:,} documents, "
                   f"{report.tokens:,} tokens ({report.dtype}, vocabulary {report.vocab_size}, "
                   f"end of document {report.eod})"), highlight=False, soft_wrap=True)
    for reason, n in report.skipped.items():
        out.print(text((f"  {n:,} ", "yellow"), REASONS.get(reason, reason), f" (first: {report.first[reason]})"),
                  highlight=False, soft_wrap=True)
    if not report.skipped:
        out.print("  nothing skipped")
