"""Reference implementations the tests compare the library against (plain Python, no kvcache
imports): written from the documented behaviour, never from the code's formulas."""
