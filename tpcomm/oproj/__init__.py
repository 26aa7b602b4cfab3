"""O-projection all-reduce: reference, producer, consumer."""
