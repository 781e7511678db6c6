"""``splitleak models|train|verify|channels|attack``: models, split runs and their captures, attacks."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from splitleak.attacks.registry import help_text as attack_help
from splitleak.audit.defaults import CONTROL_DOCS
from splitleak.cli.common import (
    DeviceOpt,
    DrawsOpt,
    ThreadsOpt,
    TlsDirOpt,
    app,
    console,
    err,
    parse_defences,
    progress,
    user_errors,
)
from splitleak.data import DOC_LEN, N_CALIB, N_EVAL, N_TRAIN
from splitleak.errors import ConfigError, IntegrityError
from splitleak.files import read_yaml
from splitleak.runs.journal import journal_entries


def _train_config(**kw):
    # lazy: torch stays out of `splitleak --help`
    from splitleak.training import make_train_config

    return make_train_config(**kw)


@app.command("train")
def train_cmd(
    out: Path = typer.Option(..., "--out", help="run directory to write (must not exist or be empty, unless --force)"),
    config: Optional[Path] = typer.Option(
        None,
        "--config",
        help="YAML file with the training configuration "
        "(model, depth, defences: [{name, args}], data, seed, ...) instead of options",
    ),
    model: str = typer.Option("tiny-gpt2", "--model", help="preset name, Hugging Face id or local directory"),
    model_path: Optional[Path] = typer.Option(None, "--model-path", help="local directory holding the model"),
    depth: Optional[int] = typer.Option(None, "--depth", help="cut after L blocks (plain split)"),
    offload_start: Optional[int] = typer.Option(
        None, "--offload-start", help="partial offloading: first server-trained block b"
    ),
    offload_length: Optional[int] = typer.Option(
        None, "--offload-length", help="partial offloading: number of server-trained blocks s"
    ),
    defence: list[str] = typer.Option(["none"], "--defence", help="defence name (repeat to compose, applied in order)"),
    defence_arg: list[str] = typer.Option([], "--defence-arg", help="KEY=VALUE (or NAME.KEY=VALUE) for a defence"),
    mode: str = typer.Option(
        "split",
        "--mode",
        help="split (plain or U-shape, by --depth / --offload-*), latent (the decoy system) or label-shielded "
        "(Bottom and Top on the client with the labels, the Trunk on the server; all three train)",
    ),
    bottom_blocks: int = typer.Option(
        6, "--bottom-blocks", help="label-shielded: blocks of the client's Bottom (003: 6; SmolLM2 cut points 6-25)"
    ),
    top_blocks: int = typer.Option(5, "--top-blocks", help="label-shielded: blocks of the client's Top (003: 5)"),
    shielded_train: str = typer.Option(
        "all",
        "--shielded-train",
        help="label-shielded: all, trunk-frozen or top-only (the baseline; no gradient crosses)",
    ),
    answer_only: bool = typer.Option(
        False, "--answer-only", help="label-shielded: supervise the answer tokens only (--data instructions)"
    ),
    latent_split: Optional[str] = typer.Option(
        None,
        "--latent-split",
        help="latent mode: a named split of the model (main, mitigation, ladder-12, ladder-8, ladder-6), or S/R",
    ),
    latent_arg: list[str] = typer.Option(
        [],
        "--latent-arg",
        help="latent mode: KEY=VALUE (width, decoys, pool, clip, sigma, output_gradient=open|clip-noise, "
        "output_clip, output_sigma, scale_gauge, gauge_entropy=os|derived, decoy_release=fresh|verbatim, "
        "teacher_weight, surrogate_layers)",
    ),
    lr: Optional[float] = typer.Option(None, "--lr", help="AdamW learning rate (default 5e-5; 3e-4 in latent mode)"),
    data: str = typer.Option("synthetic-pii", "--data", help="wikitext2, synthetic-pii, instructions or text"),
    data_path: Optional[Path] = typer.Option(
        None, "--data-path", help="folder of wiki.*.raw files, or your text files"
    ),
    seed: int = typer.Option(0, "--seed", help="victim seed: training order, defence noise, tiny-model init"),
    data_seed: int = typer.Option(
        0,
        "--data-seed",
        help="draws the documents; keep it fixed across victim seeds "
        "so that every trained model is scored on the same evaluation documents",
    ),
    steps: Optional[int] = typer.Option(
        None, "--steps", help="training steps (default: one pass over the training documents)"
    ),
    draws: str = DrawsOpt,
    precision: str = typer.Option("float32", "--precision", help="float32 or float64"),
    n_calib: int = typer.Option(N_CALIB, "--n-calib"),
    n_train: int = typer.Option(N_TRAIN, "--n-train"),
    n_eval: int = typer.Option(N_EVAL, "--n-eval"),
    doc_len: int = typer.Option(DOC_LEN, "--doc-len"),
    no_baseline: bool = typer.Option(False, "--no-baseline", help="skip the paired all-local baseline"),
    force: bool = typer.Option(
        False,
        "--force",
        help="delete an existing run directory and write the run there anew (the way to rerun one that a kill or "
        "a failure left unfinished: the in-process run starts again from the beginning); only a run splitleak wrote "
        "is deleted, never another folder, a link's target or the run --resume reads",
    ),
    device: str = DeviceOpt,
    threads: Optional[int] = ThreadsOpt,
    quiet: bool = typer.Option(False, "--quiet", help="no progress bars"),
    connect: Optional[str] = typer.Option(
        None, "--connect", help="HOST:PORT of a `splitleak serve` node: run the client (trusted node) only, over TLS"
    ),
    tls_dir: Optional[Path] = TlsDirOpt,
    checkpoint_every: Optional[int] = typer.Option(
        None,
        "--checkpoint-every",
        help="with --connect: both sides checkpoint every N steps so that --resume can continue after a kill "
        "(default 16, in the split and latent modes alike; the server needs --checkpoints)",
    ),
    resume: Optional[Path] = typer.Option(
        None,
        "--resume",
        help="with --connect: a failed run directory to continue after its newest checkpoint; its "
        "configuration is used, OUT receives the whole run",
    ),
) -> None:
    """Split-train a model over the wire, measure utility and capture the traffic into OUT. With
    --connect the server half runs in another process (`splitleak serve`), over mutual TLS."""
    # lazy: torch stays out of `splitleak --help`
    from splitleak.training import run_training

    with user_errors():
        options = dict(
            model=model,
            model_path=model_path,
            depth=depth,
            offload_start=offload_start,
            offload_length=offload_length,
            defence=defence,
            defence_arg=defence_arg,
            mode=mode,
            latent_split=latent_split,
            latent_arg=latent_arg,
            bottom_blocks=bottom_blocks,
            top_blocks=top_blocks,
            shielded_train=shielded_train,
            answer_only=answer_only,
            lr=lr,
            data=data,
            data_path=data_path,
            seed=seed,
            data_seed=data_seed,
            steps=steps,
            draws=draws,
            precision=precision,
            n_calib=n_calib,
            n_train=n_train,
            n_eval=n_eval,
            doc_len=doc_len,
            no_baseline=no_baseline,
        )
        source = f"--resume {resume}" if resume is not None else (f"--config {config}" if config is not None else None)
        if resume is not None and config is not None:
            raise ConfigError("--resume takes the configuration of the run it continues; drop --config")
        if source is not None:
            changed = [k for k, v in options.items() if v != _TRAIN_DEFAULTS[k]]
            if changed:
                raise ConfigError(
                    f"{source} and the option(s) {', '.join('--' + k.replace('_', '-') for k in changed)} "
                    "were both given; the configuration comes from one place"
                )
        if resume is not None:
            # lazy: torch stays out of `splitleak --help`
            from splitleak.runs.manifest import read_manifest
            from splitleak.training import config_from_record

            cfg = config_from_record(read_manifest(resume)["config"])
        elif config is not None:
            cfg = load_train_yaml(config)
        elif mode == "split" and depth is None and offload_start is None and offload_length is None:
            raise ConfigError("give --depth L (plain split) or --offload-start b --offload-length s")
        else:
            cfg = _options_config(**options)
        if checkpoint_every is None and connect is not None:
            checkpoint_every = 16
        try:
            with progress(quiet) as prog:
                res = run_training(
                    cfg,
                    out,
                    force=force,
                    device=device,
                    threads=threads,
                    progress=prog,
                    connect=connect,
                    tls_dir=tls_dir,
                    checkpoint_every=checkpoint_every,
                    resume=resume,
                )
        except KeyboardInterrupt:  # Ctrl-C: the run is closed already (run_training); say where it stopped
            err.print(f"[bold red]stopped:[/] {escape(_stopped(out, connect is not None))}", highlight=False)
            raise typer.Exit(130) from None
        print_summary(res)


def _stopped(out: Path, deployed: bool) -> str:
    """One line for a `train` stopped by Ctrl-C: how its run was closed, and how to go on."""
    try:
        last = journal_entries(out)[-1]
    except Exception:  # noqa: BLE001 (no run written yet, or none readable): nothing to name
        return f"interrupted before {out} held a run; nothing was written"
    if last.get("kind") != "failed":
        return f"interrupted; {out} holds an unfinished run: rerun it with --force"
    info = last.get("info") or {}
    resume = f", or continue it from its last checkpoint with --resume {out} --out NEW" if deployed else ""
    return (
        f"interrupted; {out} is closed as failed in {info.get('stage', '?')} after {info.get('steps_done', '?')} "
        f"training steps: rerun it with --force{resume}"
    )


def _options_config(**o):
    """A TrainConfig from the `train` options (as ``options`` in ``train_cmd`` names them)."""
    paths = {k: str(o[k]) if o[k] else None for k in ("model_path", "data_path")}
    same = (
        "model", "precision", "depth", "offload_start", "offload_length", "data", "seed", "data_seed", "steps", "draws"
    )  # fmt: skip
    same += ("n_calib", "n_train", "n_eval", "doc_len")
    extra: dict = {} if o["lr"] is None else {"lr": o["lr"]}
    if o["mode"] == "latent":
        extra["latent"] = _latent_options(o["model"], o["latent_split"], o["latent_arg"])
        extra.setdefault("lr", 3e-4)  # the paper's, on both sides
    elif o["mode"] == "label-shielded":
        extra["shielded"] = {
            "bottom": o["bottom_blocks"],
            "top": o["top_blocks"],
            "train": o["shielded_train"],
            "answer_only": o["answer_only"],
        }
    elif o["mode"] != "split":
        raise ConfigError(f"unknown --mode {o['mode']!r}; use split, latent or label-shielded")
    if o["mode"] != "latent" and (o["latent_split"] is not None or o["latent_arg"]):
        raise ConfigError("--latent-split and --latent-arg are for --mode latent")
    shielded_options = ("bottom_blocks", "top_blocks", "shielded_train", "answer_only")
    if o["mode"] != "label-shielded" and any(o[k] != _TRAIN_DEFAULTS[k] for k in shielded_options):
        raise ConfigError(
            "--bottom-blocks, --top-blocks, --shielded-train and --answer-only are for --mode label-shielded"
        )
    return _train_config(
        **{k: o[k] for k in same},
        **paths,
        defences=parse_defences(o["defence"], o["defence_arg"]),
        all_local_baseline=not o["no_baseline"],
        **extra,
    )


def _latent_options(model: str, named: str | None, args: list[str]) -> dict:
    """The latent config from ``--latent-split`` (a preset name or S/R) and ``--latent-arg KEY=VALUE``."""
    # lazy: torch stays out of `splitleak --help`
    from splitleak.defences import parse_defence_args
    from splitleak.models.latent import resolve_split

    if named is None:
        raise ConfigError(
            "--mode latent needs --latent-split (main, mitigation, ladder-12/8/6, or S/R: split after S, resume at R)"
        )
    s, r = resolve_split(model, named)
    return {"split_after": s, "resume_at": r, **parse_defence_args(args)}


_TRAIN_DEFAULTS = dict(
    model="tiny-gpt2",
    model_path=None,
    depth=None,
    offload_start=None,
    offload_length=None,
    defence=["none"],
    defence_arg=[],
    mode="split",
    latent_split=None,
    latent_arg=[],
    bottom_blocks=6,
    top_blocks=5,
    shielded_train="all",
    answer_only=False,
    lr=None,
    data="synthetic-pii",
    data_path=None,
    seed=0,
    data_seed=0,
    steps=None,
    draws="os",
    precision="float32",
    n_calib=N_CALIB,
    n_train=N_TRAIN,
    n_eval=N_EVAL,
    doc_len=DOC_LEN,
    no_baseline=False,
)


def load_train_yaml(path: Path):
    """A TrainConfig from a YAML mapping of its fields; unknown keys are refused by name."""
    data = read_yaml(path, "configuration", "model: ..., depth: ..., defences: [...], ...")
    return _train_config(**data)


def print_summary(res, baseline: dict | None = None) -> None:
    """The run's utility and wire summary; ``baseline`` (an audit's ``utility_baseline``) gives the
    all-local loss where the audit took it from a run it trained anyway."""
    m = res.metrics
    t = Table(title=f"run {res.run_dir}")
    t.add_column("measure")
    t.add_column("value", justify="right")
    fmt = lambda v, f="{:.4f}": "n/a" if v is None else f.format(v)  # noqa: E731
    t.add_row("held-out cross-entropy (nats)", fmt(m["heldout_ce"]))
    t.add_row("held-out perplexity (geometric mean)", fmt(m["perplexity"], "{:.2f}"))
    t.add_row("pretrained cross-entropy", fmt(m["pretrained_ce"]))
    if "privacy" in m:  # the latent mode: its reference is the frozen pretrained model
        t.add_row("increase over the pretrained model", fmt(m["ce_increase_over_pretrained"]))
        t.add_row("ε per row, one release (δ = 1e-6)", fmt(m["privacy"]["epsilon_per_row_one_release"], "{:.1f}"))
    else:
        b = baseline or m
        t.add_row("all-local cross-entropy", fmt(b["all_local_ce"]))
        t.add_row("ΔU = L_split − L_all-local", fmt(b["delta_u"]))
    w = m["wire_bytes_per_step"]
    t.add_row("wire bytes / step, client → server", f"{w.get('client_to_server', 0):,.0f}")
    t.add_row("wire bytes / step, server → client", f"{w.get('server_to_client', 0):,.0f}")
    c = m["capture"]
    t.add_row("captured documents", str(res.config.n_eval))
    if "zero_gradient_rows" in c:
        t.add_row(
            "all-zero gradient rows in capture",
            f"{c['zero_gradient_rows']} ({100 * c['zero_gradient_row_share']:.2f} %)",
        )
    console.print(t)


@app.command("verify")
def verify_cmd(run_dir: Path = typer.Argument(..., help="a run directory")) -> None:
    """Re-hash every file of a run against its hash-chained journal and, for a complete run, re-encode
    every recorded frame against the channels' ledgers of what crossed. Exit 0 when intact."""
    # lazy: torch stays out of `splitleak --help`
    from splitleak.runs.chain import verify_chain
    from splitleak.runs.verify import verify_run
    from splitleak.runs.wire import verify_wire

    res = verify_run(run_dir)
    message = res.message
    if res.ok and res.status == "complete":
        try:
            message += "; " + verify_wire(run_dir)
        except IntegrityError as exc:
            res.ok, message = False, f"{message}, but {exc}"
    if res.ok:  # a resumed run: the runs it continues, each verified, and every training step once
        try:
            message += "".join(f"; {line}" for line in [verify_chain(run_dir)] if line)
        except IntegrityError as exc:
            res.ok, message = False, f"{message}, but {exc}"
    if res.ok:
        console.print(f"[green]ok[/] {run_dir}: {message}", highlight=False)
        return
    err.print(f"[bold red]FAILED[/] {run_dir}: {message}", highlight=False)
    raise typer.Exit(1)


@app.command("channels")
def channels_cmd(
    run_dir: Path = typer.Argument(..., help="a run directory written by `splitleak train`"),
    as_json: bool = typer.Option(False, "--json", help="print the table as JSON"),
) -> None:
    """Every channel the run's split mode and defences declare (Politis & Pappas 2026, §3): direction, shape, whether the
    tap captured it, which registered attacks read it, and its status."""
    # lazy: torch stays out of `splitleak --help`
    from splitleak.audit.channels import HEADER, channel_table, channels_json, run_declaration, table_rows

    with user_errors():
        if as_json:
            print(channels_json(run_dir))
            return

        rows = channel_table(run_dir)
        t = Table(title=f"channels of {run_dir}")
        for i, col in enumerate(HEADER):
            t.add_column(col, no_wrap=i == 0)
        for row in table_rows(rows):
            t.add_row(*(Text(cell) for cell in row))
        console.print(t)
        for r in rows:
            if r["note"]:
                console.print(f"- {r['channel']}: {r['note']}", highlight=False)
        for note in run_declaration(run_dir).notes:
            console.print(f"- {note}", highlight=False)


@app.command("attack")
def attack_cmd(
    run_dir: Path = typer.Argument(
        ..., help="a run directory written by `splitleak train`, or a server's session-NNNN/ (with --documents)"
    ),
    attack: str = typer.Option(..., "--attack", help=f"one of: {attack_help()}"),
    out: Path = typer.Option(..., "--out", help="RESULT.json to write (predictions go beside it as .parquet)"),
    k: Optional[int] = typer.Option(None, "--k", help="candidate budget of the beam attackers (8, 16, 32)"),
    copy: str = typer.Option("public", "--copy", help="public (pretrained) or trained (the run's client layers)"),
    budget: Optional[str] = typer.Option(None, "--budget", help="SipIt checks per token (32, 64, 128) or 'exhaustive'"),
    readout: Optional[str] = typer.Option(
        None,
        "--readout",
        help="how the joint attacker, its shuffled-gradient "
        "control and the backward-only heuristic read the gradient: gradient "
        "(cosine of −gradient with the token embeddings; default) or pseudo-map",
    ),
    gradient_source: Optional[str] = typer.Option(
        None,
        "--gradient-source",
        help="which gradient the gradient "
        "readers read: split (at the observation point; default) or output "
        "(the U-shape's output gradient)",
    ),
    lam: Optional[float] = typer.Option(
        None, "--lam", help="mixup-unmix: the mixing weight, if known (default: estimated from the traffic)"
    ),
    phase: str = typer.Option(
        "capture",
        "--phase",
        help="capture (the evaluation documents, frozen weights) or "
        "train (the training documents, from the frames of the training steps)",
    ),
    attack_seed: int = typer.Option(0, "--attack-seed"),
    gradient_noise: Optional[float] = typer.Option(
        None, "--gradient-noise", help="observer-side noise, sigma x gradient RMS"
    ),
    gradient_bits: Optional[int] = typer.Option(
        None, "--gradient-bits", help="observer-side rounding of the gradient to b bits"
    ),
    inference: bool = typer.Option(False, "--inference", help="use the activations only (inference traffic)"),
    protocol: Optional[Path] = typer.Option(
        None, "--protocol", help="a frozen protocol file; the result carries its hash"
    ),
    documents: Optional[Path] = typer.Option(
        None,
        "--documents",
        help="when RUN_DIR is a server's capture: the client's run directory of the same session "
        "(its documents, calibration text and client layers never reached the server)",
    ),
    param: list[str] = typer.Option(
        [], "--param", help="KEY=VALUE: any parameter the attack's class takes (e.g. rule=classifier)"
    ),
    force: bool = typer.Option(False, "--force", help="replace an existing RESULT.json"),
    control_docs: int = typer.Option(
        CONTROL_DOCS,
        "--control-docs",
        help="documents of the attack's mis-paired negative control (the same attack given the traffic of other "
        "documents; 0: none)",
    ),
    no_verify: bool = typer.Option(
        False, "--no-verify", help="read the run without checking it against its journal first (the result says so)"
    ),
    device: str = DeviceOpt,
    threads: Optional[int] = ThreadsOpt,
    quiet: bool = typer.Option(False, "--quiet"),
) -> None:
    """Run one attack against a run's captured traffic and score it per token, document and span."""
    # lazy: torch and scipy stay out of `splitleak --help`
    from splitleak.attacks import make_attack_config
    from splitleak.audit.evaluate import run_attack
    from splitleak.defences import parse_defence_args
    from splitleak.report.attack_tables import attack_rows
    from splitleak.runtime import apply_threads, resolve_device

    with user_errors():
        apply_threads(threads)
        dev = resolve_device(device)
        b: int | str | None = budget
        if budget is not None and budget != "exhaustive":
            try:
                b = int(budget)
            except ValueError:
                raise ConfigError(f"--budget {budget!r} is neither an integer nor 'exhaustive'") from None
        cfg = make_attack_config(
            attack=attack,
            k=k,
            client_copy=copy,
            budget=b,
            readout=readout,
            attack_seed=attack_seed,
            gradient_noise=gradient_noise,
            gradient_bits=gradient_bits,
            inference=inference,
            gradient_source=gradient_source,
            lam=lam,
            phase=phase,
            params=parse_defence_args(param),
        )
        protocol_hash = None
        if protocol is not None:
            # lazy: pydantic stays out of `splitleak --help`
            from splitleak.audit.protocol import load_protocol

            _, protocol_hash = load_protocol(protocol)
        with progress(quiet) as prog:
            res = run_attack(
                run_dir,
                cfg,
                out=out,
                force=force,
                progress=prog,
                device=str(dev),
                protocol_hash=protocol_hash,
                documents=documents,
                verify=not no_verify,
                control_docs=control_docs,
            )
        if no_verify:
            console.print(
                f"[yellow]not verified[/]: --no-verify read {run_dir} without checking it against its journal"
            )
        t = Table(title=f"{attack} on {run_dir}")
        t.add_column("measure")
        t.add_column("value", justify="right")
        for measure, value in attack_rows(res):
            t.add_row(measure, value)
        console.print(t)
