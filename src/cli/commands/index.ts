import type { Command } from 'commander';
import { register as relay } from './relay.ts';
import { register as makeModel } from './make-model.ts';
import { register as tracker } from './tracker.ts';
import { register as node } from './node.ts';
import { register as serveApp } from './serve-app.ts';
import { register as mesh } from './mesh.ts';
import { register as demo } from './demo.ts';

/** Every subcommand registers itself here; one line each. */
export const commands: Array<(program: Command) => void> = [relay, tracker, node, makeModel, serveApp, mesh, demo];
