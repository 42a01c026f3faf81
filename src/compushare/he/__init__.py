"""CKKS homomorphic encryption for private mode (TenSEAL). Not built yet.

Private mode is planned as follows: the consumer holds the secret key, the
embeddings, the LM head, every norm and the attention itself; providers run their
span's weight projections on CKKS ciphertexts with plaintext weights and return
ciphertexts. docs/architecture.md says where it plugs into the inference path.
Nothing here is imported by the rest of the package yet.
"""
