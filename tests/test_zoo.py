"""The bundled zoo keeps the foundation issue's rules: at most 60 MB, a card for every model."""
from dspark.zoo import zoo_dir

MODELS = ("target", "draft-model", "dflash", "dspark", "dspark-rnn", "eagle3")


def test_zoo_fits_in_60_mb():
    files = [p for p in zoo_dir().rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    assert total <= 60_000_000, f"the zoo holds {total / 1e6:.1f} MB; the limit is 60 MB"


def test_every_bundled_model_has_a_card_with_its_command():
    for name in MODELS:
        folder = zoo_dir() / name
        assert (folder / "config.json").exists() and (folder / "model.safetensors").exists(), name
        card = (folder / "README.md").read_text()
        assert "```" in card, f"{name}'s card lacks the command that built it"
