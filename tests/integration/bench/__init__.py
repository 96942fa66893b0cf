"""A benchmark still measures the product (bench/), run at its smallest size."""
