from pathlib import Path

from setuptools import find_packages, setup

URL = "https://github.com/fd-cudagraph-plugin/fd-cudagraph-plugin"

setup(
    name="fd-cudagraph-plugin",
    version="0.7.0",
    description=(
        "A replacement CUDA-graph backend for PaddlePaddle FastDeploy 2.x, loaded as a plugin; "
        "tested on CPU stand-ins and a torch GPU stand-in, not yet with Paddle on a GPU"
    ),
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    # The project's repository; the README names no other.
    url=URL,
    project_urls={
        "Source": URL,
        "Issues": f"{URL}/issues",
        "Changelog": f"{URL}/blob/main/CHANGELOG.md",
    },
    python_requires=">=3.10",
    packages=find_packages(include=["fd_cudagraph_plugin", "fd_cudagraph_plugin.*"]),
    # No Paddle and no FastDeploy here: FastDeploy users already have paddlepaddle-gpu from
    # Paddle's own index, and pip must never replace it with a CPU wheel. (The PyPI project
    # named fastdeploy is unrelated to PaddlePaddle's FastDeploy.)
    # msgspec types what the ranks write in Paddle's job store; FastDeploy requires it on every
    # release (requirements.txt of 2.4 through develop), so it adds nothing to a FastDeploy
    # environment.
    install_requires=["tqdm", "msgspec>=0.18"],
    extras_require={
        "test": ["pytest", "pytest-mock", "paddlepaddle==3.3.1", "ruff", "prometheus_client"],
        "demo": ["paddlepaddle==3.3.1"],
    },
    entry_points={
        "fastdeploy.model_register_plugins": [
            "fd_cudagraph_plugin = fd_cudagraph_plugin.plugin:register",
        ],
        "console_scripts": ["fd-cudagraph = fd_cudagraph_plugin.tools.cli:main"],
    },
)
