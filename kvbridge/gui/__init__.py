"""The Gradio testbed: page layout (app), event handlers (handlers, results), Plotly charts and export."""
