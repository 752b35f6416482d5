"""`inspect`, `download`, `extract`: thin commands over dsparkctl.checkpoint."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from dsparkctl.app.download import DownloadSpec, run_download
from dsparkctl.app.extract import ExtractSpec, run_extract
from dsparkctl.cli.console import err, note, out, print_json, progress_bar, styled
from dsparkctl.cli.guard import guarded
from dsparkctl.cli.options import JsonOpt, RevisionOpt
from dsparkctl.errors import UsageError

SourceArg = Annotated[str, typer.Argument(help="A local checkpoint folder or a hub repo id (org/name).")]
WithHeadOpt = Annotated[bool, typer.Option("--with-head", help="Also take the target's embedding and LM head, which "
                                           "the draft reuses.")]


def parse_size(text: str, option: str = "--max-shard-size") -> int:
    """'5GB' -> 5_000_000_000, '512MiB' -> 536_870_912, '1000' -> 1000."""
    m = re.fullmatch(r"([0-9]{1,15}(?:\.[0-9]{1,15})?) ?([kKmMgGtT]?)(i?)[bB]?", text)  # ASCII digits only
    if not m:
        raise UsageError(f"{option} {text!r} is not a size", hint="use e.g. 5GB, 500MB or 2GiB")
    base = 1024 if m.group(3) else 1000
    size = int(float(m.group(1)) * base ** "_KMGT".index(m.group(2).upper() or "_"))
    if size > 2 ** 50:
        raise UsageError(f"{option} {text!r} is more than a petabyte", hint="use e.g. 5GB, 500MB or 2GiB")
    if size < 1:
        raise UsageError(f"{option} {text!r} is less than one byte", hint="use e.g. 5GB, 500MB or 2GiB")
    return size


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.3f} MB"


@guarded
def inspect_cmd(
    source: SourceArg,
    revision: RevisionOpt = None,
    target: Annotated[str | None, typer.Option("--target", help="Check a draft folder against this target model "
                                               "(folder, hub id or 'embedded'), from the configs alone.")] = None,
    probe: Annotated[int, typer.Option("--probe", metavar="N", help="With --target: also run N prompts through both "
                                       "models to confirm which target layers the draft reads and which token each "
                                       "draft slot predicts (0 = off).")] = 0,
    dataset: Annotated[str, typer.Option("--dataset", help="Prompt set for --probe: mt-bench, humaneval, sharegpt, "
                                         "a local file or a hub dataset id.")] = "mt-bench",
    json_out: JsonOpt = False,
) -> None:
    """Show what a checkpoint or draft folder holds: format, components, config, and any problems found."""
    from dsparkctl.app.inspect import InspectSpec, run_inspect  # its probe loads models: imported when it runs

    report = run_inspect(InspectSpec(source, revision, target, probe, dataset),
                         log=lambda m: err.print(m, highlight=False, markup=False))
    if json_out:
        print_json(report)  # strict JSON: a NaN among the user's config values prints as null
    elif "draft_format" in report:
        _print_draft(report)
    else:
        _print_report(report)
    errors = [f for f in report["findings"] if f["level"] == "error"]
    if errors:  # the report is printed in full; the exit status says it found something broken
        err.print(f"error: {len(errors)} finding(s) at level error, first: {errors[0]['check']}: "
                  f"{errors[0]['message']}", highlight=False, markup=False)
        raise typer.Exit(3)


def _print_report(r: dict[str, Any]) -> None:
    rev = f" @ {r['revision']}" if r["revision"] else ""
    out.print(styled((str(r["source"]), "bold"), f"{rev}: {r['layout']['title']} ({r['layout']['key']}), "
                     f"{r['stages'] or 1} stage(s), FP8 block {r['fp8_block'][0]}x{r['fp8_block'][1]}"))
    t = Table(title="draft components")
    for col in ("component", "tensors", "params", "bytes", "dtypes", "quant"):
        t.add_column(col, justify="right" if col in ("tensors", "params", "bytes") else "left")
    for c in r["components"]:
        t.add_row(c["component"], str(c["tensors"]), f"{c['params']:,}", f"{c['bytes']:,}",
                  " ".join(c["dtypes"]), ", ".join(c["quant"]))
    d = r["draft"]
    t.add_row(styled(("total", "bold")), str(d["tensors"]), f"{d['params']:,}", f"{d['bytes']:,}", "", "")
    out.print(t)
    dl = r["download"]
    out.print(f"draft shards: {', '.join(s['file'] for s in r['draft_shards'])}")
    out.print(f"draft-only download: {_gb(dl['draft_only_bytes'])} in {dl['shards']} of {dl['total_shards']} "
              f"shards vs {_gb(dl['total_bytes'])} for the whole checkpoint")
    if r["head_shards"]:
        out.print(f"embed/head (borrowed from the target, --with-head): {', '.join(r['head_shards'])}")
    if "transferred_bytes" in r:
        out.print(f"read over the network: {r['transferred_bytes']:,} bytes (config, index, shard headers)")
    cfg = Table(title="draft config fields")
    cfg.add_column("field")
    cfg.add_column("value")
    for k, v in r["config"].items():
        cfg.add_row(k, str(v))
    out.print(cfg)
    colour = {"ok": "green", "warning": "yellow", "error": "red"}
    for f in r["findings"]:
        out.print(styled((f"{f['level']:>7}", colour[f["level"]]), f" {f['check']}: {f['message']}"), highlight=False)


def _print_draft(r: dict[str, Any]) -> None:
    d = r["draft_format"]
    f, L, v = d["format"], d["target_layers"], d["vocabulary"]
    version = f" {f['version']}" if f["version"] else ""
    out.print(styled((r["source"], "bold"), f": {f['title']}{version} ({f['key']}), {d['kind']}"), highlight=False)
    t = Table(show_header=False)
    t.add_column("what")
    t.add_column("value")
    conf = d["confidence_head"]
    slot = d["slot_convention"]
    rows = [
        ("block", f"{d['block_size']} slots, {d['drafts_per_round']} drafts a round; {d['draft_layers']} draft layer(s)"),
        ("markov head", f"rank {d['markov']['rank']}, {d['markov']['head_type']}" if d["markov"]["rank"] else "none"),
        ("confidence head", ("reads hidden + Markov embedding" if conf["reads_markov"] else "reads hidden only")
         if conf["present"] else "none"),
        ("slot convention", f"sample_from_anchor {str(slot['sample_from_anchor']).lower()}: {slot['meaning']} "
                            f"({slot['source']})"),
        ("target layers", f"{L['field']} {L['as_written']} ({L['file_rule']})"),
        ("  canonical", f"{L['canonical']} (output of decoder layer i)"
                        + (f", of a {L['num_target_layers']}-layer target" if L["num_target_layers"] else "")),
        ("vocabulary", f"{v['draft_size']} of {v['target_size']} target tokens, map: {v['map']}"),
        ("mask token", str(d["mask_token_id"])),
        ("dtypes", ", ".join(f"{k} x{n}" for k, n in d["dtypes"].items())
         + (f"; quantized: {d['quantization']['weights']} {d['quantization']['scheme']} weights, read dequantized"
            if d["quantization"] else "")),
        ("tensors", f"{d['tensors']['stored']} stored, {d['tensors']['params']:,} own parameters"
                    + (f"; borrows {', '.join(d['tensors']['borrowed_from_target'])} from the target"
                       if d["tensors"]["borrowed_from_target"] else "")),
        ("target named", str(d["target_named"]["name_or_path"]) if d["target_named"] else "none"),
    ]
    for k, val in rows:
        t.add_row(k, val)
    out.print(t, markup=False, highlight=False)
    colour = {"ok": "green", "warning": "yellow", "error": "red"}
    for f in r["findings"]:
        out.print(styled((f"{f['level']:>7}", colour[f["level"]]), f" {f['check']}: {f['message']}"), highlight=False)


@guarded
def download_cmd(
    repo: Annotated[str, typer.Argument(help="Hub repo id (org/name).")],
    revision: RevisionOpt = None,
    local_dir: Annotated[Path | None, typer.Option("--local-dir", help="Download here instead of the Hugging "
                                                                     "Face cache.")] = None,
    with_head: WithHeadOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Download a hub checkpoint's config, index and tokenizer files and only the shards that hold the draft (resumable)."""
    def on_file(file: str, size: int) -> None:
        err.print(f"fetching {file}" + (f" ({_gb(size)})" if size else ""), highlight=False)

    doc = run_download(DownloadSpec(repo, revision, local_dir, with_head), on_file=on_file)
    if json_out:
        print_json(doc)
        return
    got, skip = (sum(f["bytes"] for f in doc[k]) for k in ("fetched", "skipped"))
    out.print(f"downloaded {len(doc['fetched'])} files ({_gb(got)}) to {doc['folder']}")
    out.print(f"skipped {len(doc['skipped'])} shards without draft tensors ({_gb(skip)}): "
              + ", ".join(f["file"] for f in doc["skipped"]), highlight=False)


@guarded
def extract_cmd(
    source: SourceArg,
    out_dir: Annotated[Path, typer.Argument(metavar="OUT", help="New folder for the draft checkpoint.")],
    revision: RevisionOpt = None,
    dequantize: Annotated[str | None, typer.Option("--dequantize", help="Write FP8/FP4 weights as this dtype "
                                                   "and drop their scales; bf16 is the one choice (--dequantize bf16)."
                                                   )] = None,
    max_shard_size: Annotated[str, typer.Option("--max-shard-size", help="Largest output file, e.g. 5GB, 500MB "
                                                "or 2GiB.")] = "5GB",
    with_head: WithHeadOpt = False,
    verify: Annotated[bool, typer.Option("--verify", help="Re-read the output and check every tensor.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Copy the draft's tensors (and their scales) out of a full checkpoint into a standalone draft folder, atomically."""
    spec = ExtractSpec(source, out_dir, revision, dequantize, parse_size(max_shard_size), with_head, verify)
    with progress_bar("extract", None, transfer=True) as update:
        doc = run_extract(spec, on_bytes=lambda n, total: update(advance=n, total=total), note=note)
    if json_out:
        print_json(doc)
        return
    out.print(f"wrote {doc['tensors']} tensors ({_gb(doc['bytes'])}) in {len(doc['shards'])} shard(s) to {doc['out']}"
              + (", verified" if doc["verified"] else ""), highlight=False)


@guarded
def convert_cmd(
    source: Annotated[str, typer.Argument(help="A draft folder of any known format (or 'default', the shipped draft).")],
    out_dir: Annotated[Path, typer.Argument(metavar="OUT", help="New folder for the converted draft.")],
    to: Annotated[str, typer.Option("--to", help="Format to write: deepspec, speculators, specforge or modelopt "
                                    "(see docs/formats.md).", metavar="FORMAT")],
    drop: Annotated[list[str] | None, typer.Option(
        "--drop", metavar="PART", help="Accept losing a part the new format cannot hold (else the conversion is "
        "refused): vocab-map, confidence-head or quantization; repeat for several: --drop vocab-map --drop "
        "quantization.")] = None,
    target: Annotated[str | None, typer.Option("--target", help="The draft's target model (folder, hub id or "
                                               "'embedded'), needed when the new format must carry rows of its "
                                               "embedding or LM head.")] = None,
    revision: RevisionOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Convert a draft between formats: tensors copied bit-identical; what the new format cannot hold is refused unless --drop allows it."""
    from dsparkctl.app.convert import ConvertSpec, run_convert

    doc = run_convert(ConvertSpec(source, out_dir, to, tuple(drop or ()), target, revision),
                      log=lambda m: err.print(m, highlight=False, markup=False))
    if json_out:
        print_json(doc)
        return
    out.print(f"wrote {doc['to']} draft ({doc['tensors']} tensors) to {doc['out']} from {doc['from']} "
              f"{doc['source']}; read back identical", highlight=False, markup=False)
    for name in doc["added_from_target"]:
        out.print(f"  copied from the target: {name} (dropped again when converted back)", highlight=False, markup=False)
    for change in doc["changes"]:
        out.print(f"  changed: {change}", highlight=False, markup=False)
    if doc["copied"]:
        out.print(f"  kept beside it: {', '.join(doc['copied'])} (fitted for these same weights)", highlight=False,
                  markup=False)
    for warning in doc["warnings"]:
        err.print(f"warning: {warning}", highlight=False, markup=False)


@guarded
def fixture_cmd(
    out_dir: Annotated[Path, typer.Argument(metavar="OUT")],
    layout: Annotated[str, typer.Option("--layout")] = "v4.1-flash",
) -> None:
    """(dev) Write a miniature checkpoint with real names and dtypes."""
    from dsparkctl.app.dev_fixture import FixtureSpec, run_dev_fixture

    out.print(str(run_dev_fixture(FixtureSpec(out_dir, layout))))


def register(app: typer.Typer) -> None:
    app.command("inspect")(inspect_cmd)
    app.command("download")(download_cmd)
    app.command("extract")(extract_cmd)
    app.command("convert")(convert_cmd)
    app.command("dev-fixture", hidden=True)(fixture_cmd)
