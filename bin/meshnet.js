#!/usr/bin/env node
// The CLI runs the TypeScript sources through tsx's loader: one source of
// truth, no stale build output to forget.
import { register } from 'tsx/esm/api';

register();
await import('../src/cli/main.ts');
