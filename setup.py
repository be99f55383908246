"""The package's files (pyproject.toml has everything else): the ``cosyvoice_triton`` packages, and the run-time
files of the repository's top-level folders, which a built wheel carries under ``cosyvoice_triton/_data/`` with the
repository's layout (``cosyvoice_triton.resources`` finds them there, or in the clone of an editable install).
Each file has one copy, in its top-level folder; the table below says what of it goes into the wheel."""

from pathlib import Path

from setuptools import find_namespace_packages, setup

DATA = "cosyvoice_triton._data"
#: top-level folder -> (its subfolders too, the patterns of its other files than ``*.py``); its ``*.py`` files (and
#: its subfolders') go in as modules
SHIPPED = {
    "model_repository": (True, ["*.pbtxt.in"]),  # the templates (config + adapter per model), render.py (`render`)
    "ensemble": (True, ["*.pbtxt.in"]),  # the pipelines' templates, beside model_repository/
    "export": (False, []),  # the scripts of export-onnx, quantize, quality, engines, convert-llm
    "loadtest": (False, []),  # the Locust files of the load tests
    "tests/fixtures": (False, ["*.wav"]),  # sample speech: the demo's source and prompt, the load tests' workload
}
NOT_PACKAGES = ["__pycache__", "*.__pycache__"]

# A tree without some of the folders (a container image's first layer installs the package alone) builds a package
# without their files, which then must be given otherwise ($COSYVOICE_TEMPLATES, the scripts run from their folders).
here = Path(__file__).parent
missing = [folder for folder in SHIPPED if not (here / folder).is_dir()]
if missing:
    print(f"setup.py: warning: {', '.join(missing)} not found: the package is built without their files")

package_dir: dict[str, str] = {}
# the gateway's page (GET /listen) and the wire format of CosyVoice's own gRPC service
package_data: dict[str, list[str]] = {"cosyvoice_triton.gateway": ["static/*", "*.proto"]}
for folder, (subfolders, patterns) in SHIPPED.items():
    if folder in missing:
        continue
    subs = find_namespace_packages(str(here / folder), exclude=NOT_PACKAGES) if subfolders else []
    for sub in ["", *subs]:
        name = ".".join(p for p in (DATA, folder.replace("/", "."), sub) if p)
        package_dir[name] = "/".join(p for p in (folder, sub.replace(".", "/")) if p)
        if patterns:
            package_data[name] = patterns

setup(
    packages=[*find_namespace_packages(include=["cosyvoice_triton", "cosyvoice_triton.*"], exclude=NOT_PACKAGES),
              *package_dir],
    package_dir=package_dir,
    package_data=package_data,
)
