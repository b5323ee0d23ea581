"""Trains CFIR's language expert on (summary, image) pairs of the index in --workdir.

    python train.py --config configs/large.py --workdir W --config.init_model=...   # see README for GPU/TPU
    python train.py --config configs/demo.py --workdir demo_work
"""

from cfir_jax import cli
from cfir_jax.errors import cli_main


@cli_main
def main():
    args, config = cli.parse(__doc__.splitlines()[0])
    cli.maybe_initialize_distributed()
    from cfir_jax import trainer
    from cfir_jax.layout import Layout
    from cfir_jax.train_data import load_train_data

    layout = Layout.of(args.workdir)
    if not config.train.init_model and layout.index_json.is_file():
        # Start from the encoder the index was built with, and export with its (frozen) vision tower.
        import json

        encoder = json.loads(layout.index_json.read_text()).get("encoder", "")
        if encoder:
            config.train.init_model = encoder
            config.train.export_model = config.train.export_model or encoder
    data = load_train_data(config, layout.root)
    result = trainer.train(config, layout.train, data)
    if config.train.export_model and (layout.train / "model").is_dir():
        import os
        import shutil

        if layout.model.exists():
            shutil.rmtree(layout.model)
        os.replace(layout.train / "model", layout.model)
    if result.already_trained:
        print(f"train: already trained to step {result.start_step} ({layout.train}/checkpoints); nothing to do")
    print("final: " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(result.metrics.items())))


if __name__ == "__main__":
    main()
