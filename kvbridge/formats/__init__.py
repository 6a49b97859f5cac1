"""Engine byte formats KVBridge reads and writes: llama.cpp's sequence state and llama-server's slot files.

Pure parsing and assembly (numpy over bytes), no I/O policy: the engine layer splits a saved state
into chunk payloads with llama_state and assembles them back; the llama-server adapter wraps the
same state in a slot file with slot_file.
"""
