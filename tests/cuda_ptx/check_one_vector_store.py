#!/usr/bin/env python3
"""Compiles a .cu file to PTX and checks that its kernel writes the 16-byte stuck signal
as one vector store: exactly one st.global.v4 of 32-bit words, and no narrower vector
stores (a signal copied as a struct of an int16 pair goes out as v2.u32 + v2.u16 + f32,
which a host polling between them reads torn). No GPU needed.

check_one_vector_store.py NVCC SOURCE NVCC_ARGS..."""
import re
import subprocess
import sys
import tempfile

nvcc, source, args = sys.argv[1], sys.argv[2], sys.argv[3:]
with tempfile.NamedTemporaryFile(suffix=".ptx") as ptx:
    subprocess.run([nvcc, "-std=c++20", "-ptx", source, "-o", ptx.name] + args, check=True)
    text = open(ptx.name, encoding="utf-8").read()
vector4 = re.findall(r"st\.global\.v4\.(?:u32|b32|s32)", text)
narrow = re.findall(r"st\.global\.v2\.(?:u16|b16|s16)", text)
print(f"{len(vector4)} st.global.v4 of 32-bit words, {len(narrow)} st.global.v2 of 16-bit words")
if len(vector4) != 1 or narrow:
    sys.exit("the stuck signal is not written as one 16-byte store")
