"""The build's one step that pyproject.toml cannot say: the wheel carries ``sample_models/`` as
``ampdoctor/sample_models/``, so that ``python -m ampdoctor.examples`` gives a user of the released
package the same sample specs as a clone (README's first command). Everything else is in pyproject.toml."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SAMPLES = Path(__file__).resolve().parent / "sample_models"


class BuildPyWithSamples(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):  # an editable install reads the clone's sample_models/ itself
            return
        dest = Path(self.build_lib) / "ampdoctor" / "sample_models"
        dest.mkdir(parents=True, exist_ok=True)
        for src in sorted(SAMPLES.glob("*.py")):
            self.copy_file(str(src), str(dest / src.name))


setup(cmdclass={"build_py": BuildPyWithSamples})
