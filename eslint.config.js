// Flat config: typescript-eslint's recommended rules on every TS file; host
// boundaries (src/protocol, model, shard, net, node import no host API) are checked
// by a restricted-imports rule so the browser build can never pull in node:*.
import js from '@eslint/js';
import tseslint from 'typescript-eslint';

const hostFree = ['src/protocol/**', 'src/model/**', 'src/shard/**', 'src/net/**', 'src/node/**'];

export default tseslint.config(
  { ignores: ['.scratch/**', 'gpu-pack/**', 'node_modules/**', 'dist/**', 'bench/results/**', 'test-results/**', 'playwright-report/**', '.models/**'] },
  js.configs.recommended,
  ...tseslint.configs.recommended,
  {
    languageOptions: { globals: { console: 'readonly', process: 'readonly', setTimeout: 'readonly', clearTimeout: 'readonly', setInterval: 'readonly', clearInterval: 'readonly', URL: 'readonly', TextEncoder: 'readonly', TextDecoder: 'readonly', crypto: 'readonly', performance: 'readonly', fetch: 'readonly', AbortController: 'readonly', queueMicrotask: 'readonly', Buffer: 'readonly', self: 'readonly', navigator: 'readonly', document: 'readonly', window: 'readonly', globalThis: 'readonly', structuredClone: 'readonly', atob: 'readonly', btoa: 'readonly', Response: 'readonly', Request: 'readonly', Headers: 'readonly', WebSocket: 'readonly', Blob: 'readonly', location: 'readonly', indexedDB: 'readonly' } },
    rules: {
      '@typescript-eslint/no-unused-vars': ['error', { argsIgnorePattern: '^_', varsIgnorePattern: '^_', caughtErrors: 'none' }],
      '@typescript-eslint/consistent-type-imports': 'error',
      'no-constant-condition': ['error', { checkLoops: false }],
    },
  },
  {
    files: hostFree.map((g) => `${g}.ts`).concat(hostFree),
    rules: {
      'no-restricted-imports': ['error', { patterns: [
        // A regex, not a gitignore-style group: a group 'net' would also match our own src/net.
        { regex: '^(node:.*|(fs|path|http|https|net|crypto|os|child_process|worker_threads|stream)(/.*)?)$', message: 'src/protocol, model, shard, net and node are host-agnostic: take the host API as a parameter.' },
        { group: ['ws', 'onnxruntime-node', 'onnxruntime-web', 'onnxruntime-web/*', 'pino', 'prom-client'], message: 'host-specific packages are injected by the host (src/host/node, src/host/browser, workers/).' },
      ] }],
    },
  },
);
