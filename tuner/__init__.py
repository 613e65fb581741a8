"""The online weight tuner: OTLP spans in, new routing weights out."""
