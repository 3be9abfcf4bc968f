#!/usr/bin/env python3
"""Checks that the folders of include/mpx include one another only downwards, in the
order of DESIGN.md's "Layout":

    core < exec < kernels < numerics < scaling < optim < layers, losses < model
    data beside kernels (it reads files into tensors: core and exec only)
    dist beside optim (it uses optim and scaling; model uses it)

A header may include its own folder and any folder of a lower or equal rank, and the
graph of folders must hold no cycle (two folders of one rank must not include each
other). Prints each include that breaks the order, with file and line; exits 1 if any.

usage: check_include_order.py INCLUDE_ROOT   (the folder that holds mpx/)
"""
import pathlib
import re
import sys

RANK = {
    'core': 0,
    'exec': 1,
    'kernels': 2, 'data': 2,
    'numerics': 3,
    'scaling': 4,
    'optim': 5, 'dist': 5,
    'layers': 6, 'losses': 6,
    'model': 7,
}

INCLUDE = re.compile(r'^\s*#\s*include\s*<mpx/([A-Za-z_0-9]+)/')


def main(argv):
    if len(argv) != 2:
        print(__doc__)
        return 2
    root = pathlib.Path(argv[1]) / 'mpx'
    faults = []
    edges = {}  # folder -> {included folder: first "file:line"}
    folders = sorted(p.name for p in root.iterdir() if p.is_dir())
    for folder in folders:
        if folder not in RANK:
            faults.append(f'include/mpx/{folder}/ has no place in the order; add it to RANK in {__file__}')
    for header in sorted(root.rglob('*.hpp')):
        rel = header.relative_to(root.parent)
        if len(rel.parts) < 3:
            continue  # the umbrella headers (mpx.hpp, core.hpp, ...) include what they gather
        folder = rel.parts[1]
        for number, line in enumerate(header.read_text(encoding='utf-8').splitlines(), 1):
            m = INCLUDE.match(line)
            if not m or m.group(1) == folder:
                continue
            target = m.group(1)
            where = f'include/{rel}:{number}'
            edges.setdefault(folder, {}).setdefault(target, where)
            if folder in RANK and target in RANK and RANK[target] > RANK[folder]:
                faults.append(f'{where}: {folder}/ includes {target}/, which is above it '
                              f'({line.strip()})')

    # A cycle between folders of one rank (or through any path): depth-first search.
    state = {}
    def visit(folder, path):
        state[folder] = 'open'
        for target in sorted(edges.get(folder, {})):
            if state.get(target) == 'open':
                cycle = path[path.index(target):] + [target]
                steps = ', '.join(f'{a}/ -> {b}/ at {edges[a][b]}' for a, b in zip(cycle, cycle[1:]))
                faults.append(f'folder cycle {" -> ".join(cycle)}: {steps}')
            elif target not in state:
                visit(target, path + [target])
        state[folder] = 'done'
    for folder in sorted(edges):
        if folder not in state:
            visit(folder, [folder])

    for fault in faults:
        print(fault)
    if faults:
        print(f'{len(faults)} include(s) against the folder order (DESIGN.md, "Layout")')
        return 1
    print(f'{len(folders)} folders, {sum(len(t) for t in edges.values())} folder dependencies, all downwards')
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv))
