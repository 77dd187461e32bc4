"""The Hub decoding method saved with every Jakiro head.

transformers runs `custom_generate/generate.py` of a repo or folder given as `custom_generate` (with
`trust_remote_code=True`), after checking that the packages in `custom_generate/requirements.txt` are installed. So
a saved head carries the decoding too:

    target.generate(**inputs, custom_generate="org/jakiro-head", draft=draft, trust_remote_code=True)

`generate.py` imports this package and hands the call to `jakiro_generate`; `requirements.txt` names the package.
`JakiroDraftModel.save_pretrained` (and therefore `push_to_hub`) writes both from `templates/custom_generate/`.
"""

import shutil
from pathlib import Path

TEMPLATE_DIR = Path(__file__).parent / "templates" / "custom_generate"
FILES = ("generate.py", "requirements.txt")
FOLDER = "custom_generate"


def write_custom_generate(save_directory) -> Path:
    """Write (or refresh) `custom_generate/generate.py` and `requirements.txt` in `save_directory`."""
    folder = Path(save_directory) / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        shutil.copyfile(TEMPLATE_DIR / name, folder / name)
    return folder


__all__ = ["FILES", "FOLDER", "TEMPLATE_DIR", "write_custom_generate"]
