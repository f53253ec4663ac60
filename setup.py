"""hvd_slowmo: SlowMo (arXiv 1910.00643) as a drop-in for horovod.torch.DistributedOptimizer.

Horovod itself is not a pip dependency (the torch.distributed engine needs only torch): its last
release (0.28.1) does not compile against PyTorch >= 2.1 as published. Build it with
``scripts/install_horovod.sh`` (see README).
"""

from setuptools import find_packages, setup

setup(
    name="hvd_slowmo",
    version="0.1.0",
    description="SlowMo (Slow Momentum) training for PyTorch over Horovod or torch.distributed",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["hvd_slowmo", "hvd_slowmo.*", "slowmo_lab", "slowmo_lab.*"]),
    # The codecs' C kernels are compiled from their source on first use (native.py).
    package_data={"hvd_slowmo.compression": ["kernels.c"]},
    python_requires=">=3.11",  # the only version tested
    install_requires=["torch>=2.1"],
    extras_require={
        "mpi": ["mpi4py>=3.1"],
        "tensorboard": ["tensorboard>=2.10", "matplotlib>=3.5"],
        "examples": [
            "torchvision",
            "scikit-learn>=1.0",
            "mnist1d",
            "tensorboard>=2.10",
            "matplotlib>=3.5",
            "tqdm",
        ],
        "test": [
            "pytest>=7",
            "pytest-timeout>=2",
            "scikit-learn>=1.0",
            "mnist1d",
            "tensorboard>=2.10",
        ],
    },
    entry_points={
        "console_scripts": [
            "hvd-slowmo-report=slowmo_lab.report:main",
            "hvd-slowmo-sweep=slowmo_lab.sweep:main",
        ]
    },
    license="Apache-2.0",
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
