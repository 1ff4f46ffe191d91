/**
 * The donor page's build: index.html + src/app, the node worker
 * (workers/node.worker.ts, ES module worker) and the service worker
 * (workers/sw.ts, vite-plugin-pwa injectManifest).
 *
 * onnxruntime-web is resolved to its "extern wasm" build: the worker chunk
 * then carries only ORT's JS API, and ORT loads its runtime
 * (`ort-wasm-simd-threaded*.{mjs,wasm}`) from /ort/, which this config
 * serves in dev and copies into dist/. Two reasons: the bundled build makes
 * ORT's pthread workers re-import our whole worker chunk (they would run the
 * node a second time), and files at stable URLs can be precached.
 */
import { createReadStream, readFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import { defaultClientConditions, defineConfig, type Plugin } from 'vite';
import { VitePWA } from 'vite-plugin-pwa';

/** Cross-origin isolation: SharedArrayBuffer, so WASM threads. */
export const ISOLATION_HEADERS = {
  'Cross-Origin-Opener-Policy': 'same-origin',
  'Cross-Origin-Embedder-Policy': 'require-corp',
  'Cross-Origin-Resource-Policy': 'same-origin',
} as const;

/** ORT runtime files the page can need: plain WASM (CPU EP) and the asyncify build behind `onnxruntime-web/webgpu`. */
export const ORT_RUNTIME_FILES = [
  'ort-wasm-simd-threaded.mjs',
  'ort-wasm-simd-threaded.wasm',
  'ort-wasm-simd-threaded.asyncify.mjs',
  'ort-wasm-simd-threaded.asyncify.wasm',
] as const;

const ortDist = fileURLToPath(new URL('./node_modules/onnxruntime-web/dist/', import.meta.url));

function ortRuntime(): Plugin {
  return {
    name: 'meshnet:ort-runtime',
    configureServer(server) {
      server.middlewares.use((req, res, next) => {
        const m = /\/ort\/([\w.-]+)$/.exec(req.url?.split('?')[0] ?? '');
        const file = m?.[1];
        if (!file || !(ORT_RUNTIME_FILES as readonly string[]).includes(file)) return next();
        res.setHeader('Content-Type', file.endsWith('.wasm') ? 'application/wasm' : 'text/javascript');
        for (const [k, v] of Object.entries(ISOLATION_HEADERS)) res.setHeader(k, v);
        createReadStream(ortDist + file).pipe(res);
      });
    },
    generateBundle() {
      for (const file of ORT_RUNTIME_FILES) {
        this.emitFile({ type: 'asset', fileName: `ort/${file}`, source: readFileSync(ortDist + file) });
      }
    },
  };
}

export default defineConfig({
  // Relative URLs: the same dist/ works at / and under a sub-path.
  base: './',
  publicDir: 'public',
  resolve: { conditions: ['onnxruntime-web-use-extern-wasm', ...defaultClientConditions] },
  build: { outDir: 'dist', target: 'es2022', emptyOutDir: true, chunkSizeWarningLimit: 2048 },
  worker: { format: 'es' },
  server: { headers: ISOLATION_HEADERS },
  preview: { headers: ISOLATION_HEADERS },
  plugins: [
    ortRuntime(),
    VitePWA({
      strategies: 'injectManifest',
      srcDir: 'workers',
      filename: 'sw.ts',
      // src/app registers it itself, after first paint, and reports failures in the page.
      injectRegister: false,
      manifestFilename: 'manifest.webmanifest',
      includeAssets: ['icons/icon.svg', 'icons/apple-touch-icon.png'],
      manifest: {
        name: 'meshnet — donate your GPU',
        short_name: 'meshnet',
        description: 'Keep this page open to run part of a large language model for others.',
        start_url: './',
        scope: './',
        display: 'standalone',
        background_color: '#0f172a',
        theme_color: '#0f172a',
        icons: [
          { src: 'icons/icon-192.png', sizes: '192x192', type: 'image/png' },
          { src: 'icons/icon-512.png', sizes: '512x512', type: 'image/png' },
          { src: 'icons/maskable-512.png', sizes: '512x512', type: 'image/png', purpose: 'maskable' },
          { src: 'icons/icon.svg', sizes: 'any', type: 'image/svg+xml' },
        ],
      },
      injectManifest: {
        globPatterns: ['**/*.{html,js,mjs,css,wasm,png,svg,webmanifest}'],
        // The ORT runtime is ~27 MB (asyncify) and ~14 MB (plain): precached so an offline reload can still serve.
        maximumFileSizeToCacheInBytes: 64 * 1024 * 1024,
        rollupFormat: 'es',
      },
    }),
  ],
});
