from setuptools import find_packages, setup

setup(
    name="deepspeed-ext",
    version="0.1.0",
    description="Universal checkpoints for DeepSpeed AutoTP + ZeRO: tag, convert, resume at any TP/DP degree",
    packages=find_packages(include=["deepspeed_ext", "deepspeed_ext.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "deepspeed>=0.17", "safetensors", "numpy", "tqdm", "jax", "orbax-checkpoint",
                      "ml_dtypes", "transformers", "google-crc32c"],
    extras_require={"test": ["pytest", "hypothesis", "transformers"],
                    # AutoTP through the Hugging Face Trainer / Accelerate (docs/trainers.md)
                    "trainer": ["transformers>=4.50.1", "accelerate>=1.6.0"]},
    entry_points={"console_scripts": ["deepspeed-ext=deepspeed_ext.cli:main"]},
)
