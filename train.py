"""Trains CFIR's language expert on (summary, image) pairs of the index in --workdir.

    python train.py --config configs/large.py --workdir W --config.init_model=...   # see README for GPU/TPU
    python train.py --config configs/demo.py --workdir demo_work
    python train.py --config configs/demo.py:full --workdir demo_work       # D-BEiT-3 Full: both towers, pixels
    python train.py --config configs/large.py --compile-only --topology v5p:4x4x4   # TPU programs, no TPU needed
"""

from cfir_jax.core import cli
from cfir_jax.core.cli import cli_main


@cli_main
def main():
    args, config = cli.parse(__doc__.splitlines()[0])
    if args.compile_only:
        from cfir_jax.aot.compile import compile_command

        return compile_command("train", config, args.topology)
    cli.maybe_initialize_distributed()
    from cfir_jax.stores import lock

    with lock.hold(args.workdir):  # one writer per workdir (process 0 of a job holds it)
        if config.train.get("images", "cache") == "pixels":
            _train_full(args, config)
        else:
            _train(args, config)


def _train_full(args, config):
    """D-BEiT-3 Full (train.images='pixels'): both towers from the corpus' pixels, in W/train_full -> W/model_full."""
    from cfir_jax.commands.train import run_full

    result = run_full(config, args.workdir)
    if result.already_trained:
        print(f"train: already trained to step {result.start_step} ({args.workdir}/train_full/checkpoints); "
              "nothing to do")
    print("final: " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(result.metrics.items())))


def _train(args, config):
    from cfir_jax.stores.layout import Layout
    from cfir_jax.train import trainer
    from cfir_jax.train.data import load_train_data

    layout = Layout.of(args.workdir)
    # The document baseline (train.text=document, the paper's "document only") runs and exports beside the main
    # model, so training it never replaces CFIR's summary-trained model.
    run_dir, model_dir = (layout.train_document, layout.model_document) if config.train.text == "document" else \
        (layout.train, layout.model)
    if not config.train.init_model and layout.index_json.is_file():
        # Start from the encoder the index was built with, and export with its (frozen) vision tower.
        import json

        encoder = layout.recorded_path(json.loads(layout.index_json.read_text()), "encoder")
        if encoder:
            config.train.init_model = str(encoder)
            config.train.export_model = config.train.export_model or str(encoder)
    data = load_train_data(config, layout.root)
    result = trainer.train(config, run_dir, data)
    if config.train.export_model and (run_dir / "model").is_dir():
        from cfir_jax.stores.atomic_write import replace_dir

        replace_dir(run_dir / "model", model_dir)
    if result.already_trained:
        print(f"train: already trained to step {result.start_step} ({run_dir}/checkpoints); nothing to do")
    print("final: " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(result.metrics.items())))


if __name__ == "__main__":
    main()
