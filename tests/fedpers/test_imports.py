"""Import layering: ``fedpers.data`` does not import the configuration that checks it."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_fedpers_data_imports_without_fedpers_config() -> None:
    code = (
        "import importlib, pkgutil, sys\n"
        "import fedpers.data\n"
        "names = [m.name for m in pkgutil.iter_modules(fedpers.data.__path__)]\n"
        "for name in names:\n"
        "    importlib.import_module(f'fedpers.data.{name}')\n"
        "print(','.join(sorted(names)))\n"
        "print('fedpers.config' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    modules, config_loaded = result.stdout.split()
    assert "client" in modules.split(",")  # the module that used to import RunConfig
    assert config_loaded == "False"
