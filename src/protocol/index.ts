export * from './base64.ts';
export * from './envelopes.ts';
export * from './errors.ts';
export * from './frames.ts';
export * from './headers.ts';
export * from './ids.ts';
export * from './tensor.ts';
export * from './tracker.ts';
