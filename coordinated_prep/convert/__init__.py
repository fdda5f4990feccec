"""``coordprep convert``: write a dataset as record files, Parquet (:mod:`.parquet`) or WebDataset
tar shards (:mod:`.tar`)."""

from coordinated_prep.convert.parquet import DEFAULT_ROW_GROUP_SIZE, DEFAULT_SHARD_SIZE, ConversionResult, convert_imagefolder
from coordinated_prep.convert.tar import convert_to_tar

__all__ = ["DEFAULT_ROW_GROUP_SIZE", "DEFAULT_SHARD_SIZE", "ConversionResult", "convert_imagefolder", "convert_to_tar"]
