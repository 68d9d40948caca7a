"""The embedded demos (`ppokit demo`): movie reviews, the guessing game, the calculator tool; and the tiny tokenizers and models they (and the tests and
benchmarks) build locally."""
