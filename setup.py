from setuptools import find_packages, setup

# The base install is what tagging, to-universal and resuming need. The bridges are extras
# (deepspeed_ext/extras.py lists the modules each provides; docs/install.md).
HF = ["transformers>=4.50.1"]
MAXTEXT = ["jax", "orbax-checkpoint>=0.12.8,<0.13", "ml_dtypes", *HF]  # an Orbax internal is used: orbax_private.py
TRAINER = [*HF, "accelerate>=1.6.0"]

setup(
    name="deepspeed-ext",
    version="0.1.0",
    description="Universal checkpoints for DeepSpeed AutoTP + ZeRO: tag, convert, resume at any TP/DP degree",
    packages=find_packages(include=["deepspeed_ext", "deepspeed_ext.*"]),
    python_requires=">=3.10",
    # DeepSpeed: the releases the test suite runs on, both ends (0.18.8 and 0.19.8; docs/support-matrix.md).
    install_requires=["torch>=2.4", "deepspeed>=0.18.8,<=0.19.8", "safetensors", "numpy", "tqdm", "google-crc32c",
                      # ISA-L's CRC-32, 4x zlib's; where no wheel is built, zlib's is used
                      "isal; platform_machine == 'x86_64' or platform_machine == 'AMD64'"
                      " or platform_machine == 'aarch64' or platform_machine == 'arm64'"],
    extras_require={
        "hf": HF,
        "maxtext": MAXTEXT,
        "trainer": TRAINER,
        "all": sorted(set(MAXTEXT + TRAINER)),
        "test": ["pytest", "pytest-xdist", "hypothesis", *HF],
    },
    entry_points={"console_scripts": ["deepspeed-ext=deepspeed_ext.cli:main"]},
)
