"""CKKS homomorphic encryption for private mode (Microsoft SEAL via tenseal.sealapi).

  plan.py     pure numpy: how an encrypted matrix-vector product is laid out in slots
  ckks.py     parameter whitelist, the consumer's keys, checked deserialisation of peer bytes
  matvec.py   the provider's product on pre-encoded weight diagonals
  groups.py   a decoder layer's four products (q/k/v, o, gate/up, down) and their rotations

The consumer holds the secret key and runs everything nonlinear; providers multiply
their plaintext weights by ciphertexts (pipeline/server/private.py, private_worker.py;
pipeline/client/private_chain.py). docs/security.md says what this protects.
"""
