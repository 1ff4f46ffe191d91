/**
 * The order vitest starts its files in (vitest.config.ts `sequence.sequencer`): project by project, in the
 * order the config lists them, and the longest files first within each, by how long each held its worker in
 * a CI run (file-seconds.json, written by scripts/file-seconds.mjs). Files the table does not know (under
 * 3 s, or new) come after the ones it knows, in vitest's order.
 *
 * vitest's own order puts the longest first only from a local results cache, which a clean clone has none
 * of: there the order was the file system's, and a long WebGPU suite could start last and run alone at the
 * end while the other worker idled. A project's files stay together because vitest hands a finished file's
 * process to the next file only when that file is queued next and of the same project that shares its
 * processes (isolate: false).
 */
import { readFileSync } from 'node:fs';
import { relative } from 'node:path';
import { BaseSequencer, type TestSpecification } from 'vitest/node';

const SECONDS = JSON.parse(readFileSync(new URL('./file-seconds.json', import.meta.url), 'utf8')) as Record<string, number>;

export class LongestFirst extends BaseSequencer {
  override async sort(files: TestSpecification[]): Promise<TestSpecification[]> {
    const root = this.ctx.config.root;
    const projects = this.ctx.projects;
    const seconds = (f: TestSpecification) => SECONDS[relative(root, f.moduleId).split('\\').join('/')] ?? 0;
    const base = await super.sort(files);
    return base
      .map((file, i) => ({ file, i, project: projects.indexOf(file.project), s: seconds(file) }))
      .sort((a, b) => a.project - b.project || b.s - a.s || a.i - b.i)
      .map((x) => x.file);
  }
}
