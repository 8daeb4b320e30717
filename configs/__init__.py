"""TOML presets (models and servers) shipped as package data."""
import importlib.resources
import tomllib


def load_preset(name: str) -> dict:
    """Returns the parsed preset `name` (with or without `.toml`)."""
    file_name = name if name.endswith(".toml") else f"{name}.toml"
    resource = importlib.resources.files(__name__).joinpath(file_name)
    if not resource.is_file():
        available = sorted(p.name for p in importlib.resources.files(__name__).iterdir() if p.name.endswith(".toml"))
        raise FileNotFoundError(f"no preset {name!r}; available: {', '.join(available) or 'none'}")
    return tomllib.loads(resource.read_text())
