#!/usr/bin/env node
// Packs bench/gpu.ts into a self-contained folder (default gpu-pack/, git-ignored) that runs on a
// GPU machine with no Node.js and no network: this machine's node binary and dawn.node xz'd, the
// onnxruntime-web runtime files, the bench bundled into one .mjs (esbuild), the PyTorch anchor and
// run.sh. ≤ 60 MiB. On the machine: `bash gpu-pack/run.sh "$OUT"` (see docs/benchmarks.md).
import { execFileSync } from 'node:child_process';
import { copyFileSync, existsSync, mkdirSync, readdirSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { build } from 'esbuild';

const root = resolve(fileURLToPath(new URL('..', import.meta.url)));
const out = resolve(process.argv[2] ?? join(root, 'gpu-pack'));
rmSync(out, { recursive: true, force: true });
mkdirSync(join(out, 'ort'), { recursive: true });

// onnxruntime-node is never used by the GPU bench; its native addon must not be bundled.
const stub = join(out, 'onnxruntime-node-stub.mjs');
writeFileSync(stub, 'export const InferenceSession = {}; export const Tensor = class {}; export const env = {};\n');
await build({
  entryPoints: [join(root, 'bench/gpu.ts')],
  outfile: join(out, 'bench.mjs'),
  bundle: true,
  platform: 'node',
  format: 'esm',
  target: 'node20',
  minify: true,
  alias: { 'onnxruntime-node': stub },
  // dawn.node is loaded from the pack by path (--dawn); the package's own loader is not needed.
  external: ['webgpu'],
  banner: { js: "import { createRequire as __cr } from 'node:module'; const require = __cr(import.meta.url);" },
  logLevel: 'warning',
});
rmSync(stub);

const xz = (src, dst) => execFileSync('sh', ['-c', `xz -T0 -6 -c "${src}" > "${dst}"`]);
xz(process.execPath, join(out, 'node.xz'));
xz(join(root, 'node_modules/webgpu/dist/linux-x64/dawn.node'), join(out, 'dawn.node.xz'));
const ortDist = join(root, 'node_modules/onnxruntime-web/dist');
for (const f of readdirSync(ortDist)) {
  // The webgpu bundle loads the asyncify build; the Node build (the WASM rows) the plain one.
  if (/^ort-wasm-simd-threaded(\.asyncify)?\.(mjs|wasm)$/.test(f)) {
    if (f.endsWith('.wasm')) xz(join(ortDist, f), join(out, 'ort', `${f}.xz`));
    else copyFileSync(join(ortDist, f), join(out, 'ort', f));
  }
}
copyFileSync(join(root, 'bench/gpu_torch.py'), join(out, 'gpu_torch.py'));
// Debian's Vulkan loader, when this machine has the .deb (apt-get download libvulkan1): the GPU machine lacks it.
const debDir = join(root, '.cache/debs');
if (existsSync(debDir)) for (const f of readdirSync(debDir)) if (f.startsWith('libvulkan1_')) copyFileSync(join(debDir, f), join(out, f));

writeFileSync(
  join(out, 'run.sh'),
  `#!/usr/bin/env bash
# Runs the packed GPU bench: correctness on 'small', 1B-shaped decode on WebGPU and WASM, then the
# PyTorch eager anchor when python3 has torch. Results (JSON + logs) go to \${1:-./out}.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "\${1:-$here/out}"; res="$(cd "\${1:-$here/out}" && pwd)"
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
xz -dc "$here/node.xz" > "$work/node"; chmod +x "$work/node"
xz -dc "$here/dawn.node.xz" > "$work/dawn.node"
mkdir -p "$work/ort"; cp "$here"/ort/*.mjs "$work/ort/"; for f in "$here"/ort/*.xz; do xz -dc "$f" > "$work/ort/$(basename "$f" .xz)"; done
cp "$here/bench.mjs" "$work/"; cp "$work"/ort/*.mjs "$work/ort"/*.wasm "$work/" 2>/dev/null
if ! ldconfig -p 2>/dev/null | grep -q libvulkan.so.1; then
  for d in "$here"/libvulkan1_*.deb; do [ -f "$d" ] && dpkg -x "$d" / && ldconfig; done
fi
[ -z "\${VK_ICD_FILENAMES:-}" ] && [ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ] && export VK_ICD_FILENAMES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
[ -z "\${VK_ICD_FILENAMES:-}" ] && [ -f /usr/share/vulkan/icd.d/nvidia_icd.json ] && export VK_ICD_FILENAMES=/usr/share/vulkan/icd.d/nvidia_icd.json
cd "$work"
timeout "\${MESH_BENCH_TIMEOUT:-360}" ./node bench.mjs --dawn "$work/dawn.node" --wasm-dir "$work/ort" --out "$res/gpu.json" "\${@:2}" 2>&1 | tee "$res/gpu.log" | grep -v 'onnxruntime:' | tail -40
if python3 -c 'import torch, transformers' 2>/dev/null; then
  timeout 120 python3 "$here/gpu_torch.py" --out "$res/torch.json" 2>&1 | tee "$res/torch.log" | tail -10
fi
`,
);
execFileSync('chmod', ['+x', join(out, 'run.sh')]);

let total = 0;
const walk = (d) => {
  for (const f of readdirSync(d)) {
    const p = join(d, f);
    const s = statSync(p);
    if (s.isDirectory()) walk(p);
    else total += s.size;
  }
};
walk(out);
console.log(`packed ${out}: ${(total / 2 ** 20).toFixed(1)} MiB`);
if (total > 60 * 2 ** 20) {
  console.error('over the 60 MiB budget');
  process.exit(1);
}
