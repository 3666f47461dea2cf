"""Domain logic of eagle3-datagen: plain typed functions over Parquet shard references, no Prefect imports."""
